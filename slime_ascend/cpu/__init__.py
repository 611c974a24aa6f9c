"""The ``cpu`` plugin: slime on the host CPU (see :mod:`slime_ascend.cpu.plugin`)."""
