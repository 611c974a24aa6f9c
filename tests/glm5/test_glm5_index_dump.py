"""``train.dsa_index_dump`` (the ``dsa-determinism`` plugin's ``ascend_dsa_index_dump_dir``) on slime's own glm5
spec, against the torch engine's ``dump_dsa_index_sets``, as slime's loop runs them: the engine generates each
sample (prefill, then one token a step), the train side runs slime's ``get_batch`` on the samples (packed, padded
to 128) and the spec's forward. Every layer's key sets, IndexShare's reusing layers included, are the engine's at
every fed position (``slime_ascend.dsa.index_sets.compare``), and the sets the train side wrote are the ones its
sparse attention read (skip layers: their computing layer's)."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slime

pytest.importorskip("megatron.core")
pytest.importorskip("slime.backends.megatron_utils.hf_to_megatron", reason="real slime is not on PYTHONPATH")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import single_process_megatron  # noqa: E402
from glm5_spec_fixtures import (K, Wrap, glm5_model, glm5_patched, megatron_config, slime_args,  # noqa: E402
                                thd_positions)

PROMPTS = [[5, 17, 300, 42, 99, 1000, 44, 7, 7, 512, 3, 80], [9, 8, 7, 6, 5], [400, 401, 2, 2, 2, 2, 2, 2, 2, 2, 9]]
NEW_TOKENS = [20, 14, 9]


class _Iterator:
    """What slime's ``get_batch`` asks of its ``DataIterator``: the micro-batch's fields (each sample's tokens, and
    the lengths and loss mask of its response)."""

    def __init__(self, tokens: list[torch.Tensor], response_lengths: list[int]):
        self.fields = {"tokens": list(tokens), "total_lengths": [len(t) for t in tokens],
                       "response_lengths": list(response_lengths),
                       "loss_masks": [torch.ones(n, dtype=torch.int) for n in response_lengths]}

    def get_next(self, keys):
        return {key: self.fields[key] for key in keys}


@contextlib.contextmanager
def _cpu_accelerator():
    """slime's accelerator registry with ``cpu`` selected (its ``get_batch`` places tensors on
    ``accelerator.current_device()``); restored afterwards."""
    from slime.utils import accelerator as a

    from slime_ascend.cpu import accelerator as cpu_accelerator

    with pytest.MonkeyPatch.context() as mp:
        a._register_builtin_backends()
        mp.setitem(a._REGISTRY, "cpu", a._REGISTRY["cuda"])  # recorded so that the teardown drops our entry
        mp.setenv("SLIME_ACCELERATOR", "cpu")
        a.reset_accelerator()
        cpu_accelerator.register(a)
        try:
            yield
        finally:
            a.reset_accelerator()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """(train records, rollout records, the packed micro-batch's cu_seqlens) of the tiny GLM-5's samples."""
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights

    from slime_ascend import patch
    from slime_ascend.dsa.index_sets import ROLLOUT_GLOB, TRAIN_GLOB, load_records
    from slime_ascend.rollout.torch_engine.engine import TorchEngine
    from slime_ascend.rollout.torch_engine.model import load_model, save_model

    work = tmp_path_factory.mktemp("dsa-dump")
    path = save_model(load_model(None, torch.float32, seed=3, glm5=True), work / "tiny-glm5")
    engine = TorchEngine(str(path), dump_dsa_index_sets=work / "rollout")
    samples = []
    for i, (prompt, new) in enumerate(zip(PROMPTS, NEW_TOKENS)):
        out = engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": new, "sampling_seed": i,
                                                                      "ignore_eos": True}})
        samples.append(torch.tensor(prompt + out["output_ids"]))
    args = types.SimpleNamespace(ascend_dsa_index_dump_dir=str(work / "train"))
    with _cpu_accelerator(), single_process_megatron(), glm5_patched() as glm5:
        from slime.backends.megatron_utils import model as slime_model

        model = glm5_model(glm5, slime_args(path), megatron_config()).eval()
        load_hf_weights(slime_args(path), [Wrap(Wrap(model))], str(path))
        dump = patch.get("train.dsa_index_dump")
        dump.install(args)
        try:
            keys = ["tokens", "total_lengths", "response_lengths", "loss_masks"]
            batch = slime_model.get_batch(_Iterator(samples, NEW_TOKENS), keys)
            params = batch["packed_seq_params"]
            lengths = params.cu_seqlens_q.diff().tolist()
            with torch.no_grad():
                model(batch["tokens"], thd_positions(lengths), None, packed_seq_params=params)
        finally:
            dump.remove()
        assert not dump.applied and not hasattr(glm5.SparseMLA, "_writer")  # removed: slime's own Function again
    return load_records(work / "train", TRAIN_GLOB), load_records(work / "rollout", ROLLOUT_GLOB), params.cu_seqlens_q


def test_every_layer_attends_to_the_engines_key_sets(dumps):
    from slime_ascend.dsa.index_sets import compare

    train, rollout, cu = dumps
    assert [r["layer"] for r in train] == [0, 1, 2, 3]  # one call of the sparse attention per layer
    assert len(cu) == len(PROMPTS) + 2 and int(cu[-1]) % 128 == 0  # the samples, then slime's padding segment
    assert len(rollout) == len(PROMPTS)
    result = compare(train, rollout)
    fed = sum(len(p) + n - 1 for p, n in zip(PROMPTS, NEW_TOKENS))
    assert result.unmatched == 0 and result.train_samples == len(PROMPTS)
    assert sorted(result.layers) == [0, 1, 2, 3]
    assert all(c.positions == fed and c.differing == 0 for c in result.layers.values()), result.lines()
    assert result.equal


def test_index_share_layers_record_what_they_reuse(dumps):
    train, _, _ = dumps
    by_layer = {r["layer"]: r["indices"] for r in train}
    assert torch.equal(by_layer[1], by_layer[0]) and torch.equal(by_layer[3], by_layer[2])
    assert not torch.equal(by_layer[0], by_layer[2])
    # index_topk of the past keys, where a query has more: the selection decides
    assert ((by_layer[0] >= 0).sum(1) == K["index_topk"]).sum() > 0


def test_a_changed_train_side_set_is_found(dumps):
    """The comparison has teeth on these very records: one query's set changed in one layer is one difference."""
    from slime_ascend.dsa.index_sets import compare

    train, rollout, _ = dumps
    changed = [dict(r) for r in train]
    indices = changed[2]["indices"].clone()
    q = len(PROMPTS[0]) + 3  # a decode position of the first sample with index_topk keys chosen of more
    assert (indices[q] >= 0).all()
    indices[q, 0] = next(k for k in range(q + 1) if k not in indices[q].tolist())
    changed[2]["indices"] = indices
    result = compare(changed, rollout)
    assert result.layers[2].differing == 1 and result.layers[0].differing == 0
