"""vllm-pve-deploy's test bed: a local simulated Proxmox VE GPU fleet (see docs/testbed.md).

    from vpd_testbed import Testbed
    tb = Testbed(hosts=1, containers=[129], gpus=4).up()
    ...
    tb.down()
"""

__all__ = ["Testbed", "TestbedError"]


def __getattr__(name):  # lazy: `deploy testbed --help` must not pay for the whole package
    if name in __all__:
        from . import core
        return getattr(core, name)
    raise AttributeError(name)
