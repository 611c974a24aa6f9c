"""The name ``slime_ascend_bootstrap.pth`` imports (installed copies of it, and upstream patch 0001's
``SLIME_PLUGINS=slime_ascend._bootstrap``, name it): the bootstrap is :mod:`slime_ascend.startup.bootstrap`."""

from .startup.bootstrap import activate, activation_error, raise_activation_error, started  # noqa: F401
