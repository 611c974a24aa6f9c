"""GLM-5 (``glm_moe_dsa``) on devices without CUDA: device-neutral counterparts of the CUDA-only parts of
slime's GLM-5 spec (``slime_plugins/models/glm5``). Pure torch; see :mod:`slime_ascend.glm5.ops`."""
