"""The ``reward-mix`` plugin: General-RL rewards as a declared, traceable mix of components.

R = sum_k w_k R_k - sum_j lambda_j P_j, each component and penalty named in the YAML; every sample keeps
its components, penalties, failure reason and policy versions (``Sample.metadata`` and, through to
training, ``Sample.train_metadata``); per-component means reach slime's logged metrics; an environment
or grader failure is never scored as a low reward. :mod:`.mix` is the pure part, :mod:`.hooks` the slime
adapter, :mod:`.plugin` the declaration.
"""
