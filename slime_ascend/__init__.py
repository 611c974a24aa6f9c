"""slime-ascend: run THUDM/slime on Huawei Ascend NPUs, plus GLM-5.x post-training methods.

Importing this package is cheap and inert: it never imports torch_npu, ray, megatron or
slime. Everything heavy is imported lazily by the module that needs it.
"""

__version__ = "0.1.0"
