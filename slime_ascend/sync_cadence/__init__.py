"""The ``sync-cadence`` plugin: GLM-5's weight-push cadence — push every K updates, reset the optimizer
after each push. :mod:`.optimizer` is the reset itself, :mod:`.plugin` the declaration; the runtime patch
``train.reset_optimizer_on_push`` calls it after slime's ``update_weights``."""
