"""The npu plugin's runtime patches applied to real slime modules, and removed again."""

import types

import pytest
import torch

from slime_ascend import patch

pytestmark = pytest.mark.slime


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, num_gpus=0, resources={"NPU": 2}, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_placement_group_asks_for_npu_and_removes_cleanly(ray_cluster):
    import slime.ray.placement_group as pg_mod

    p = patch.get("driver.ray_npu_resources")
    original_ray, original_pg, original_info = pg_mod.ray, pg_mod.placement_group, pg_mod.InfoActor
    p.install(modules={"slime.ray.placement_group": pg_mod})
    try:
        pg, bundle_indices, gpu_ids = pg_mod._create_placement_group(2)
        assert pg.bundle_specs == [{"NPU": 1.0, "CPU": 1.0}, {"NPU": 1.0, "CPU": 1.0}]
        assert sorted(int(g) for g in gpu_ids) == [0, 1]  # NPU accelerator ids from Ray
        ray_cluster.util.remove_placement_group(pg)
    finally:
        p.remove()
    assert pg_mod.ray is original_ray and not p.applied
    assert pg_mod.placement_group is original_pg and pg_mod.InfoActor is original_info


def test_placement_group_without_any_npu_in_the_cluster_fails_at_once():
    """slime waits for ever on a placement group nobody can place: a cluster with no NPU says so."""
    from slime_ascend.patch.driver.ray_npu_resources import NoDeviceResource, require_device_resource

    bundles = [{"NPU": 1, "CPU": 1}] * 2
    with pytest.raises(NoDeviceResource, match=r"needs 2 NPU .* advertises no NPU.*Fix: start Ray"):
        require_device_resource(bundles, "NPU", {"CPU": 8.0, "GPU": 2.0})
    require_device_resource(bundles, "NPU", {"CPU": 8.0, "NPU": 1.0})  # some: Ray may still place it (or scale)
    require_device_resource([{"CPU": 1}], "NPU", {"CPU": 8.0})  # nothing asked
    require_device_resource(bundles, None, {})  # the cpu plugin asks for no device resource


def test_actor_options_are_translated():
    from slime_ascend.patch.driver.ray_npu_resources import translate_bundles, translate_options

    assert translate_options({"num_gpus": 0.4, "num_cpus": 0.4}) == {"num_cpus": 0.4, "resources": {"NPU": 0.4}}
    assert translate_options({"num_gpus": 0, "resources": {"x": 1}}) == {"resources": {"x": 1}}
    assert translate_bundles([{"GPU": 1, "CPU": 1}]) == [{"CPU": 1, "NPU": 1}]


def test_train_actor_local_id_comes_from_npu_ids(ray_cluster):
    import slime.ray.train_actor as ta

    p = patch.get("driver.ray_npu_resources")
    p.install(modules={"slime.ray.train_actor": ta})
    try:
        @ray_cluster.remote(resources={"NPU": 1})
        def ids():
            from slime_ascend.patch.driver.ray_npu_resources import NPURay
            import ray

            return NPURay(ray).get_gpu_ids()

        assert len(ray_cluster.get(ids.remote())) == 1
        assert type(ta.ray).__name__ == "NPURay"
    finally:
        p.remove()
    assert type(ta.ray).__name__ == "module"


def test_all_ray_targets_match_this_slime():
    assert patch.get("driver.ray_npu_resources").verify() == []


def test_fc1_partition_dim_fixed_before_gather():
    import slime.backends.megatron_utils.update_weight.common as common
    p = patch.get("train.fc1_gather_layout")
    assert p.verify() == []
    seen = []
    original = common.all_gather_param
    fake = types.ModuleType("fake_common")
    fake.all_gather_param = lambda name, param: seen.append((name, param.partition_dim)) or param
    fake.all_gather_params_async = lambda infos: [seen.append((i.name, q.partition_dim)) for i, q in infos]
    fake.__name__ = "slime.backends.megatron_utils.update_weight.common"
    p.apply({fake.__name__: fake})
    try:
        w = torch.nn.Parameter(torch.zeros(2))
        w.tensor_model_parallel, w.partition_dim = True, 1
        fake.all_gather_param("decoder.layers.0.mlp.linear_fc1.weight", w)
        v = torch.nn.Parameter(torch.zeros(2))
        v.tensor_model_parallel, v.partition_dim = True, 1
        fake.all_gather_param("decoder.layers.0.mlp.linear_fc2.weight", v)
        info = types.SimpleNamespace(name="x.linear_fc1.weight")
        u = torch.nn.Parameter(torch.zeros(2))
        u.tensor_model_parallel, u.partition_dim = True, 1
        fake.all_gather_params_async([(info, u)])
    finally:
        p.remove()
    assert seen == [("decoder.layers.0.mlp.linear_fc1.weight", 0), ("decoder.layers.0.mlp.linear_fc2.weight", 1),
                    ("x.linear_fc1.weight", 0)]
    assert common.all_gather_param is original


def test_disable_compile_on_real_modules():
    import megatron.core.jit as jit
    import slime.utils.ppo_utils as ppo
    p = patch.get("train.disable_torch_compile")
    assert p.verify() == []
    compiled = ppo.compute_approx_kl
    p.install()
    try:
        assert ppo.compute_approx_kl is compiled._torchdynamo_orig_callable
        assert jit.jit_fuser is jit.noop_decorator
        jit.enable_jit_fuser()
        assert jit.jit_fuser is jit.noop_decorator
        a, b = torch.randn(5), torch.randn(5)
        assert torch.allclose(ppo.compute_approx_kl(a, b, kl_loss_type="k1"), a - b)
    finally:
        p.remove()
    assert ppo.compute_approx_kl is compiled


def test_mindspeed_patch_reports_absence_cleanly():
    problems = patch.get("train.mindspeed_repatch").verify()
    import importlib.util

    if importlib.util.find_spec("mindspeed") is None:
        assert problems and problems[0].startswith("cannot import target")
    else:
        assert problems == []
