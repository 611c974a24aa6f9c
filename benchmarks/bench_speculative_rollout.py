"""Speculative decoding in the torch engine: decode tokens/s with a draft model vs without, side by side in one run.

The served model and its draft are built so that how much they agree is known (the engine's STANDALONE algorithm;
issue 43 asks for GLM-5's MTP layer as the draft, which transformers drops on load, so a separate draft model stands
in for it here):

* the draft: a Qwen3 of ``--draft-layers`` layers (hidden 256, byte vocabulary);
* the served model: the draft's layers and head, then ``--extra-layers`` more layers. In the **agreeing** pair the
  extra layers' output projections are zero, so the served model computes the draft's function at several times
  its cost (every draft token is kept: the speed ceiling of the mechanism); in the **near** pair they are small
  random values (scale ``--near-scale``), so the two disagree now and then.

Each pair: the same prompts decoded greedily by one engine without speculation and one with
``--speculative-num-steps K``, interleaved; reported per pair: decode tokens/s of each and their ratio, tokens per
verifying forward (SGLang's accept length), and the largest gap between the two engines' log-probs of the same tokens
(fp32). Goal (issue 43): >= 1.5x decode tokens/s where the accept length is >= 2, log-prob gap <= 1e-6, and the
tokens identical (greedy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._host import describe  # noqa: E402

NAME = "speculative_rollout"
TARGET = 1.5


def _pair(root: Path, draft_layers: int, extra_layers: int, near_scale: float | None) -> tuple[Path, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer

    def config(layers: int) -> Qwen3Config:
        return Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

    torch.manual_seed(0)
    served = Qwen3ForCausalLM(config(draft_layers + extra_layers)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for layer in served.model.layers[draft_layers:]:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.copy_(torch.zeros_like(w) if near_scale is None else near_scale * torch.randn(w.shape, generator=g))
    draft = Qwen3ForCausalLM(config(draft_layers)).eval()
    state = {k: v for k, v in served.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    draft.load_state_dict(state)
    tokenizer = build_byte_tokenizer()
    label = "agree" if near_scale is None else "near"
    out = []
    for name, model in (("served", served), ("draft", draft)):
        path = root / f"{label}-{name}"
        model.save_pretrained(str(path), safe_serialization=True)
        tokenizer.save_pretrained(str(path))
        out.append(path)
    return out[0], out[1]


def _decode(engine, prompts: list[list[int]], new: int) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    answers = [engine.generate({"input_ids": p, "return_logprob": True, "sampling_params": {
        "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}) for p in prompts]
    return time.perf_counter() - t0, answers


def run(quick: bool = False, draft_layers: int = 2, extra_layers: int = 10, steps: int = 4, new: int | None = None,
        prompts: int | None = None, repeats: int | None = None, near_scale: float = 0.001) -> list[dict]:
    from slime_ascend.rollout.torch_engine.engine import TorchEngine

    new = new or (32 if quick else 128)
    n_prompts = prompts or (2 if quick else 4)
    repeats = repeats or (1 if quick else 3)
    batch = [[3 + (7 * i + j) % 250 for j in range(64)] for i in range(n_prompts)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        for scale in (None, near_scale):
            served, draft = _pair(Path(tmp), draft_layers, extra_layers, scale)
            plain = TorchEngine(model_path=served)
            spec = TorchEngine(model_path=served, speculative_draft_model_path=draft, speculative_num_steps=steps)
            _decode(plain, batch[:1], 8), _decode(spec, batch[:1], 8)  # warm-up
            times: dict[str, list[float]] = {"plain": [], "spec": []}
            answers: dict[str, list[dict]] = {}
            for r in range(repeats):
                for way, engine in ((("plain", plain), ("spec", spec)) if r % 2 == 0 else
                                    (("spec", spec), ("plain", plain))):
                    seconds, answers[way] = _decode(engine, batch, new)
                    times[way].append(seconds)
            same = all(a["output_ids"] == b["output_ids"] for a, b in zip(answers["plain"], answers["spec"]))
            gap = max(abs(x[0] - y[0]) for a, b in zip(answers["plain"], answers["spec"])
                      for x, y in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]))
            verify = sum(a["meta_info"]["spec_verify_ct"] for a in answers["spec"])
            accept = sum(a["meta_info"]["spec_accept_length"] * a["meta_info"]["spec_verify_ct"]
                         for a in answers["spec"]) / max(1, verify)
            tokens = n_prompts * new
            plain_tps = tokens / statistics.median(times["plain"])
            spec_tps = tokens / statistics.median(times["spec"])
            ratio = spec_tps / plain_tps
            label = "agreeing draft" if scale is None else f"near draft (extra layers at scale {scale:g})"
            passed = (ratio >= TARGET and gap <= 1e-6 and same) if accept >= 2 else None
            rows.append({"name": f"{NAME}/{'agree' if scale is None else 'near'}", "ratio": ratio,
                         "target": f">={TARGET} at accept>=2", "passed": passed,
                         "detail": f"{label}: {tokens} tokens greedy ({n_prompts} prompts x {new}), plain "
                                   f"{plain_tps:.0f} tok/s, speculative (K={steps}) {spec_tps:.0f} tok/s, ratio "
                                   f"{ratio:.2f}; accept length {accept:.2f} tokens a verifying forward; tokens "
                                   f"{'identical' if same else 'DIFFER'}; log-prob gap {gap:.1e}; draft {draft_layers} "
                                   f"layers, served {draft_layers + extra_layers}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--extra-layers", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4, help="draft tokens per verifying forward (K)")
    ap.add_argument("--new", type=int, default=None, help="tokens decoded per prompt")
    ap.add_argument("--near-scale", type=float, default=0.001)
    args = ap.parse_args()
    if args.draft_layers < 1 or args.extra_layers < 0 or args.steps < 1:
        ap.error("--draft-layers and --steps must be >= 1, --extra-layers >= 0")
    print(f"host: {describe()}; torch threads {torch.get_num_threads()}")
    for row in run(args.quick, args.draft_layers, args.extra_layers, args.steps, args.new, near_scale=args.near_scale):
        print(row["detail"])
        verdict = {True: "PASS", False: "FAIL", None: "n/a (accept length < 2)"}[row["passed"]]
        print(f"RESULT {row['name']} ratio={row['ratio']:.3f} target={row['target']} {verdict}")


if __name__ == "__main__":
    main()
