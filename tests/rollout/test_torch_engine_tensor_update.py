"""``/update_weights_from_tensor`` on the torch engine, fed exactly as slime's colocated push feeds SGLang
(``_send_to_colocated_engine``: sglang's FlattenedTensorBucket pickled by its MultiprocessingSerializer, one
call per bucket, ``load_format="flattened_bucket"``, ``weight_version=str(n)``): a version serves only once all of
its buckets arrived and were checked, and is then reported like a disk update's."""

from __future__ import annotations

import httpx
import pytest
import torch

from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.tensor_update import use_file_system_sharing
from slime_ascend.weight_sync.tensor_sharing import serialize_named_tensors

from conftest import need

HTTP = httpx.Client(timeout=300, trust_env=False)
PROMPT = [1, 17, 250, 3, 999, 42]


@pytest.fixture
def file_system_sharing():
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    use_file_system_sharing()
    yield
    mp.set_sharing_strategy(before)


def serialize_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[str, dict]:
    """One bucket as slime serializes it; the dict must stay alive until the call returns (slime's long_lived)."""
    utils = need("sglang.srt.utils", "slime's serializer comes from sglang")
    bucket_mod = need("sglang.srt.weight_sync.tensor_bucket")
    bucket = bucket_mod.FlattenedTensorBucket(named_tensors=named)
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return utils.MultiprocessingSerializer.serialize(data, output_str=True), data


def push(url: str, named, version: str) -> httpx.Response:
    text, _alive = serialize_bucket(named)
    return HTTP.post(f"{url}/update_weights_from_tensor", json={
        "serialized_named_tensors": [text], "load_format": "flattened_bucket", "flush_cache": False,
        "weight_version": version})


def greedy(url: str) -> dict:
    r = HTTP.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4,
                                                                                     "temperature": 0.0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_buckets_switch_the_version_once_complete(file_system_sharing):
    engine = TorchEngine()
    gen = torch.Generator().manual_seed(7)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16)  # slime pushes bf16
           for k, v in engine.model.state_dict().items()}
    names = list(new)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    with engine.start_in_thread() as url:
        before = greedy(url)
        r = push(url, [(n, new[n]) for n in first], "3")
        assert r.status_code == 200 and "staged" in r.json()["message"], r.text
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "default"
        assert greedy(url)["output_ids"] == before["output_ids"]  # half a version never serves

        # a broken bucket is refused and leaves the staged half and the served version as they were
        bad = new[second[0]].clone()
        bad.view(-1)[0] = float("nan")
        r = push(url, [(second[0], bad)], "3")
        assert r.status_code == 400 and "non-finite" in r.json()["error"]
        r = push(url, [("model.layers.9.mlp.up_proj.weight", new[second[0]])], "3")
        assert r.status_code == 400 and "not a weight of the served model" in r.json()["error"]
        r = push(url, [(second[0], new[second[0]][:1])], "3")
        assert r.status_code == 400 and "has shape" in r.json()["error"]

        r = push(url, [(n, new[n]) for n in second], "3")
        assert r.status_code == 200 and "weight version 3 loaded" in r.json()["message"], r.text
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "3"
        served = engine.model.state_dict()
        assert all(torch.equal(served[n], new[n].float()) for n in names)
        out = greedy(url)
        assert out["meta_info"]["weight_version"] == "3"

        # a bucket of a new version drops what another version had staged
        assert push(url, [(n, new[n]) for n in first], "4").status_code == 200
        assert push(url, [(n, new[n]) for n in first], "5").status_code == 200
        assert push(url, [(n, new[n]) for n in second], "5").status_code == 200
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "5"


def push_list(url: str, named, version: str) -> httpx.Response:
    """One bucket as a list of (name, tensor) pairs (SGLang's format without load_format), pickled as
    MultiprocessingSerializer does (weight_sync.tensor_sharing.serialize_named_tensors)."""
    from slime_ascend.weight_sync.tensor_sharing import serialize_named_tensors

    return HTTP.post(f"{url}/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(named)], "flush_cache": False,
        "weight_version": version})


def test_a_bucket_that_does_not_complete_its_version_is_copied_out_of_the_senders_memory(file_system_sharing):
    """A bucket in the engine's own dtype is read in place from the sender's shared memory; one that does not
    complete its version is copied before the call returns, since the sender may reuse the buffer at once (slime's
    buckets are), and the version that completes holds what each bucket held when it was sent."""
    engine = TorchEngine()
    assert engine.dtype == torch.float32
    sent = {k: (v.detach() + 0.01).share_memory_() for k, v in engine.model.state_dict().items()}
    want = {k: v.clone() for k, v in sent.items()}
    names = list(sent)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    with engine.start_in_thread() as url:
        assert push_list(url, [(n, sent[n]) for n in first], "7").status_code == 200
        for n in first:
            sent[n].add_(1.0)  # the sender reuses its buffer for the next bucket
        r = push_list(url, [(n, sent[n]) for n in second], "7")
        assert r.status_code == 200 and "weight version 7 loaded" in r.json()["message"], r.text
    served = engine.model.state_dict()
    assert all(torch.equal(served[n], want[n]) for n in names)


def test_donated_tensors_serve_in_place_and_others_are_copied(file_system_sharing):
    """``donate_tensors: true`` (the opd pool's staged teacher): a whole fp32 version in one call becomes the model's
    weights without a copy, its storage the sender's shared memory (what the sender writes afterwards is served:
    shown here by breaking the contract once); a tensor of another dtype is converted and copied as always; without
    the field every tensor is copied; a field that is not a bool is refused naming it."""
    engine = TorchEngine()
    own = engine.model.state_dict()
    sent = {k: (v.detach() + 0.01).share_memory_() for k, v in own.items()}
    names = list(sent)
    bf16 = names[0]
    sent[bf16] = sent[bf16].to(torch.bfloat16).share_memory_()  # converted on arrival: copied
    want = {k: v.float().clone() for k, v in sent.items()}
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    with engine.start_in_thread() as url:
        r = HTTP.post(f"{url}/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors([(n, sent[n]) for n in names])],
            "weight_version": "8", "donate_tensors": True})
        assert r.status_code == 200 and "weight version 8 loaded" in r.json()["message"], r.text
        served = engine.model.state_dict()
        assert all(torch.equal(served[n], want[n]) for n in names)
        shared = {n for n in names if params[n].is_shared()}
        assert shared == set(names) - {bf16}, set(names) - shared
        donated = names[1]
        sent[donated].mul_(0.0)  # the contract broken on purpose: the engine serves the sender's memory
        assert not torch.equal(want[donated], sent[donated])
        assert torch.equal(engine.model.state_dict()[donated], sent[donated])

        # the same push without the field: every tensor copied (into the storage the model holds now), so what
        # the sender writes afterwards is not served
        again = {k: v.clone().share_memory_() for k, v in want.items()}
        r = push_list(url, [(n, again[n]) for n in names], "9")
        assert r.status_code == 200, r.text
        for tensor in again.values():
            tensor.add_(1.0)
        assert all(torch.equal(engine.model.state_dict()[n], want[n]) for n in names)

        r = HTTP.post(f"{url}/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors([(names[1], again[names[1]])])],
            "weight_version": "10", "donate_tensors": "yes"})
        assert r.status_code == 400 and "donate_tensors must be true or false" in r.json()["error"], r.text
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "9"


def test_file_descriptor_handles_are_refused_naming_the_strategy():
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_descriptor")
    try:
        engine = TorchEngine()
        name, tensor = next(iter(engine.model.state_dict().items()))
        with engine.start_in_thread() as url:
            r = push(url, [(name, tensor.clone())], "1")
        assert r.status_code == 400 and "file_system" in r.json()["error"], r.text
    finally:
        mp.set_sharing_strategy(before)


def test_other_payloads_are_refused():
    engine = TorchEngine()
    with engine.start_in_thread() as url:
        r = HTTP.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["%%%"]})
        assert r.status_code == 400 and "base64" in r.json()["error"]
        import base64
        import pickle

        evil = base64.b64encode(pickle.dumps(print)).decode()
        r = HTTP.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert r.status_code == 400 and "refusing to unpickle builtins.print" in r.json()["error"]
        r = HTTP.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["x"],
                                                                 "load_format": "safetensors"})
        assert r.status_code == 400 and "load_format" in r.json()["error"]


# ---------------------------------------------------------------- no code from the wire (issue 40)
class _Call:
    """Pickles as ``fn(*args)``: the shape of a gadget (``fn`` may itself be a gadget's result)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args

    def __call__(self):  # pickle insists that a reduce's callable is callable
        raise AssertionError


def _post_pickle(url: str, obj) -> httpx.Response:
    import base64
    import pickle

    text = base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode()
    return HTTP.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": [text]})


def test_a_torch_load_of_bytes_from_the_wire_is_refused_and_runs_nothing(tmp_path):
    """The exploit shape: the payload's reduce calls ``torch.storage._load_from_bytes`` (``torch.load`` with
    ``weights_only=False``) on torch-saved bytes of an object whose ``__reduce__`` runs a command. Before the fix
    the command ran as the engine's user (the marker file was written) and only then came a 400."""
    import io
    import os

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    saved = io.BytesIO()
    torch.save(Evil(), saved)
    # pickle names the function by where it lives now: with Megatron imported (as in slime's loop, and in a test
    # run where an earlier test imported it) torch.storage._load_from_bytes is megatron.core.safe_globals'
    # safe_load_from_bytes, which loads just as unsafely; either name must be refused
    load = torch.storage._load_from_bytes
    engine = TorchEngine()
    with engine.start_in_thread() as url:
        r = _post_pickle(url, [("model.norm.weight", _Call(load, saved.getvalue()))])
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert f"refusing to unpickle {load.__module__}.{load.__name__}" in error and "\n" not in error, error
        assert not marker.exists()
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "default"


def test_a_getattr_gadget_is_refused_and_runs_nothing(tmp_path):
    """``getattr`` chains from an allowed function reach ``os.system``:
    ``getattr(getattr(getattr(f, '__globals__'), 'get')('os'), 'system')('touch ...')``; only
    ``getattr(torch, <dtype name>)`` is accepted."""
    marker = tmp_path / "ran"
    rebuild = torch._utils._rebuild_tensor_v2
    globals_get = _Call(getattr, _Call(getattr, rebuild, "__globals__"), "get")
    os_module = _Call(globals_get, "os")
    gadget = _Call(_Call(getattr, os_module, "system"), f"touch {marker}")
    engine = TorchEngine()
    with engine.start_in_thread() as url:
        r = _post_pickle(url, [("model.norm.weight", gadget)])
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "refusing getattr" in error and "__globals__" in error and "\n" not in error, error
        assert not marker.exists()
    # what getattr may still fetch: torch's dtypes
    from slime_ascend.rollout.torch_engine.tensor_update import TensorUnpickler

    assert TensorUnpickler.find_class(None, "builtins", "getattr")(torch, "bfloat16") is torch.bfloat16
