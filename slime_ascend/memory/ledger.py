"""The memory ledger of a slime job: every large object of every role, with its bytes, owner and lifetime.

Pure Python (no torch). :func:`build_ledger` takes a model config (an HF ``config.json`` dict, read by
:meth:`ModelShape.from_hf`) and a :class:`Layout` (parallel sizes, micro-batch tokens, dtypes, recompute,
rollout engine, OPD teachers, weight-sync format) and returns a :class:`Ledger`: a list of :class:`Entry`
(role, object, category, bytes, owner, lifetime, where) and each role's peak, the largest sum of the
objects that are live together in one phase of that role's process.

Categories: ``model state``, ``saved activations``, ``operator workspace``, ``communication buffers``,
``live IO``, ``allocator margin``. Lifetimes are phases of a process: ``whole run`` (every phase),
``train step``, ``log-prob forward``, ``weight sync`` (train processes); ``serving``, ``weight sync``
(rollout/teacher engines).

Roles and where they live:

* ``actor``: slime's Megatron train actor, the most loaded rank (the pipeline stage with the largest
  model state + activations).
* ``critic``: slime's PPO critic (another Megatron train process; value head [1, h] in place of
  ``lm_head``), only with ``Layout.critic``.
* ``reference``: runs *inside the actor's process*: slime keeps the reference weights (and a backup of
  the actor's own) in pinned host memory (``slime/utils/tensor_backper.py``: ``torch.empty_like(param,
  device="cpu", pin_memory=True)``) and copies them into the actor's parameters for the reference
  log-prob pass; its device objects are that forward's transients. The actor process's peak
  (:attr:`Ledger.process_peaks`) adds them to the actor's ``log-prob forward`` phase.
* ``rollout``: one SGLang rollout engine rank (engine TP = ``--rollout-num-gpus-per-engine``): weights in
  the sync format, KV cache, the DSA indexer's key cache, prefill workspace, the received weight bucket.
* ``teacher-i``: each OPD teacher engine (served over HTTP by its own engine, as slime-ascend's ``opd``
  plugin does), sized from the teacher's config.

Assumptions stated once (each formula's docstring gives its source):

* Megatron layout: ``world = TP*PP*CP*DP``; sequence parallel on whenever TP > 1 (slime's Megatron
  scripts pass ``--sequence-parallel``; Megatron requires it for MoE with TP); expert TP = 1; experts
  split evenly over EP; routed tokens balanced over experts.
* Activations are Megatron's fused kernels (TransformerEngine/MindSpeed): flash attention (no s^2
  scores) unless ``Layout.attention == "eager"``; no dropout unless ``Layout.dropout``. ``Layout.kernels ==
  "cpu"`` counts the unfused kernels of ``slime_ascend.cpu.spec`` instead (:func:`layer_activation_terms`), the
  job ``slime-ascend memory --measure`` runs on the host.
* The loss path of the last stage: Megatron's ``Float16Module`` casts the logits to fp32 and drops the 16-bit
  ones (``megatron/core/transformer/module.py``, ``float16_to_fp32``); slime's ``_VocabParallelLogProbEntropy``
  keeps one fp32 softmax buffer for backward and, off CUDA (Ascend, CPU), its entropy term materialises
  ``softmax * logits`` (``slime/utils/ppo_utils.py``, ``sum_softmax_logits``; einsum on CUDA): ``12 V/t`` bytes
  per token in all.
* MTP (``num_nextn_predict_layers``): counted where they live, when the layout says so: trained on the last stage
  (``mtp_training``, slime's ``--enable-mtp-training``: their parameters in the model state, one decoder layer's
  activations plus the ``eh_proj`` input per MTP layer, and the MTP loss's fp32 logits and softmax) and as the
  engines' NEXTN draft (``rollout_mtp``: bf16 weights and a KV pool of their own over the same tokens).
* Not included: CUDA/ACL graphs and NCCL/HCCL internal buffers, the framework context (~0.5-1 GiB per
  device on a real accelerator), the DSA indexer's training activations, kernel autotuning caches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

CATEGORIES: tuple[str, ...] = (
    "model state", "saved activations", "operator workspace", "communication buffers", "live IO",
    "allocator margin",
)
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
SYNC_FORMATS: tuple[str, ...] = ("none", "fp8-block", "int8-w8a8", "int4-group")
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
KERNELS: tuple[str, ...] = ("fused", "cpu")
WHOLE_RUN = "whole run"
TRAIN_PHASES: tuple[str, ...] = ("train step", "log-prob forward", "weight sync")
ENGINE_PHASES: tuple[str, ...] = ("serving", "weight sync")
GIB = 1024**3


# --------------------------------------------------------------------------------------------- model


# each weight tensor is one ledger row (about 30 us each on a 2-core Xeon): 1M rows would take a minute
MAX_WEIGHT_TENSORS = 400_000


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the ledger needs, read from an HF config (dense, GQA, MoE, MLA, DSA indexer)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False        # Qwen3: q_norm/k_norm [head_dim] per layer
    qkv_bias: bool = False       # Qwen2: q/k/v biases
    experts: int = 0
    moe_ffn: int = 0
    experts_per_token: int = 0
    shared_ffn: int = 0          # total intermediate size of the shared experts (0: none)
    moe_layers: tuple[int, ...] = ()
    router_bias: bool = False    # DeepSeek-V3 e_score_correction_bias
    q_lora_rank: int = 0         # MLA (0: plain q_proj)
    kv_lora_rank: int = 0        # MLA when > 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    index_heads: int = 0         # DSA lightning indexer (DeepSeek-V3.2 / GLM-5) when > 0
    index_head_dim: int = 0
    model_type: str = ""
    mtp_layers: int = 0          # num_nextn_predict_layers (DeepSeek-V3 / GLM-5's MTP): counted only where the
                                 # layout trains them (mtp_training) or the engines draft with them (rollout_mtp)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelShape":
        """Read an HF ``config.json`` dict (a nested ``text_config`` is used when present)."""
        if not isinstance(cfg, dict):
            raise ValueError("the model config must be a JSON object (an HF config.json)")
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "model_type": cfg.get("model_type", "")}

        def need(key: str, *alts: str) -> int:
            for k in (key, *alts):
                v = cfg.get(k)
                if v is not None:
                    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                        raise ValueError(f"config field {k!r} must be a positive integer, got {v!r}")
                    return v
            raise ValueError(f"config has no {key!r}; pass an HF config.json of a decoder-only model")

        def opt(key: str, *alts: str) -> int:
            for k in (key, *alts):
                v = cfg.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
            return 0

        hidden, layers = need("hidden_size"), need("num_hidden_layers")
        heads = need("num_attention_heads")
        kv_heads = opt("num_key_value_heads") or heads
        head_dim = opt("head_dim") or hidden // heads
        experts = opt("num_experts", "n_routed_experts", "num_local_experts")
        moe_ffn = opt("moe_intermediate_size") if experts else 0
        model_type = str(cfg.get("model_type", ""))
        moe_layers: tuple[int, ...] = ()
        shared = 0
        if experts:
            if "first_k_dense_replace" in cfg or "n_routed_experts" in cfg:  # DeepSeek / GLM-MoE
                first = opt("first_k_dense_replace")
                freq = opt("moe_layer_freq") or 1
                moe_layers = tuple(i for i in range(layers) if i >= first and i % freq == 0)
                shared = opt("n_shared_experts") * moe_ffn
            else:  # Qwen-MoE / Mixtral
                step = opt("decoder_sparse_step") or 1
                only = cfg.get("mlp_only_layers") or ()
                if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) for i in only):
                    raise ValueError(f"config field 'mlp_only_layers' must be a list of layer numbers, got {only!r}")
                only = set(only)
                moe_layers = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
                shared = opt("shared_expert_intermediate_size")
            moe_ffn = moe_ffn or need("intermediate_size")
        kv_lora = opt("kv_lora_rank")
        if heads % kv_heads:
            raise ValueError(f"config field 'num_key_value_heads' ({kv_heads}) must divide 'num_attention_heads' "
                             f"({heads}). Fix: correct the config (grouped-query attention shares each KV head "
                             f"among num_attention_heads / num_key_value_heads query heads)")
        tensors = layers * 16 + len(moe_layers) * experts * 3  # the ledger walks every weight tensor
        if tensors > MAX_WEIGHT_TENSORS:
            raise ValueError(f"config: {layers} layers{f' x {experts} experts' if experts else ''} is about {tensors:,} weight tensors; "
                             f"the ledger models at most {MAX_WEIGHT_TENSORS:,} (GLM-5: ~60,000). Fix: check "
                             f"'num_hidden_layers' and 'num_experts' in the config")
        mla = ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # read only with a kv_lora_rank
        return cls(
            hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            ffn=need("intermediate_size"), vocab=need("vocab_size"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type.startswith("qwen3"),
            qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))) and not kv_lora,
            experts=experts, moe_ffn=moe_ffn, experts_per_token=opt("num_experts_per_tok") if experts else 0,
            shared_ffn=shared, moe_layers=moe_layers, router_bias=experts > 0 and "n_routed_experts" in cfg,
            kv_lora_rank=kv_lora, **{k: opt(k) if kv_lora else 0 for k in mla},
            index_heads=opt("index_n_heads"), index_head_dim=opt("index_head_dim"), model_type=model_type,
            mtp_layers=opt("num_nextn_predict_layers"),
        )


def param_shapes(m: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter as (HF name, shape): the slow, obvious count the closed forms are checked against,
    and the tensor list the weight-sync bucket and the quantised sizes are computed from.

    Names follow transformers' Qwen2/Qwen3/Llama/Qwen3-MoE/DeepSeek-V3 modules (MLA: ``q_a_proj``,
    ``kv_a_proj_with_mqa``, ...; DSA indexer as in DeepSeek-V3.2: ``indexer.wq_b``, ``indexer.wk``,
    ``indexer.k_norm`` (LayerNorm, weight + bias), ``indexer.weights_proj``)."""
    h = m.hidden
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab, h))]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        a = p + "self_attn."
        if m.mla:
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                out += [(a + "q_a_proj.weight", (m.q_lora_rank, h)), (a + "q_a_layernorm.weight", (m.q_lora_rank,)),
                        (a + "q_b_proj.weight", (m.heads * qk, m.q_lora_rank))]
            else:
                out.append((a + "q_proj.weight", (m.heads * qk, h)))
            out += [(a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h)),
                    (a + "kv_a_layernorm.weight", (m.kv_lora_rank,)),
                    (a + "kv_b_proj.weight", (m.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
                    (a + "o_proj.weight", (h, m.heads * m.v_head_dim))]
        else:
            q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
            out += [(a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)), (a + "v_proj.weight", (kv, h)),
                    (a + "o_proj.weight", (h, q))]
            if m.qkv_bias:
                out += [(a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)), (a + "v_proj.bias", (kv,))]
            if m.qk_norm:
                out += [(a + "q_norm.weight", (m.head_dim,)), (a + "k_norm.weight", (m.head_dim,))]
        if m.index_heads:
            x = a + "indexer."
            out += [(x + "wq_b.weight", (m.index_heads * m.index_head_dim, m.q_lora_rank or h)),
                    (x + "wk.weight", (m.index_head_dim, h)), (x + "k_norm.weight", (m.index_head_dim,)),
                    (x + "k_norm.bias", (m.index_head_dim,)), (x + "weights_proj.weight", (m.index_heads, h))]
        mp = p + "mlp."
        if i in m.moe_layers:
            out.append((mp + "gate.weight", (m.experts, h)))
            if m.router_bias:
                out.append((mp + "gate.e_score_correction_bias", (m.experts,)))
            for e in range(m.experts):
                ep = f"{mp}experts.{e}."
                out += [(ep + "gate_proj.weight", (m.moe_ffn, h)), (ep + "up_proj.weight", (m.moe_ffn, h)),
                        (ep + "down_proj.weight", (h, m.moe_ffn))]
            if m.shared_ffn:
                sp = mp + ("shared_experts." if m.router_bias else "shared_expert.")
                out += [(sp + "gate_proj.weight", (m.shared_ffn, h)), (sp + "up_proj.weight", (m.shared_ffn, h)),
                        (sp + "down_proj.weight", (h, m.shared_ffn))]
                if not m.router_bias:  # Qwen2-MoE's sigmoid gate of the shared expert
                    out.append((mp + "shared_expert_gate.weight", (1, h)))
        else:
            out += [(mp + "gate_proj.weight", (m.ffn, h)), (mp + "up_proj.weight", (m.ffn, h)),
                    (mp + "down_proj.weight", (h, m.ffn))]
    out.append(("model.norm.weight", (h,)))
    if not m.tied:
        out.append(("lm_head.weight", (m.vocab, h)))
    return out


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, split as Megatron shards them."""

    dense: int    # attention, norms, dense MLP, router, shared experts: sharded over TP
    expert: int   # routed experts: sharded over EP (expert TP = 1)


def layer_params(m: ModelShape, i: int) -> LayerParams:
    """Closed form of one layer's parameter count.

    Attention (GQA): ``h*(a*d) + 2*h*(g*d) + (a*d)*h`` (+ ``a*d + 2*g*d`` biases, + ``2*d`` q/k norms);
    MLA: ``h*q_lora + q_lora + q_lora*a*(nope+rope) + h*(kv_lora+rope) + kv_lora + kv_lora*a*(nope+v) +
    a*v*h``; norms ``2h``; SwiGLU MLP ``3*h*ffn``; MoE: router ``E*h`` (+ ``E`` bias), experts
    ``E*3*h*moe_ffn``, shared ``3*h*shared`` (+ ``h`` Qwen gate); DSA indexer ``q_in*ih*id + h*id + 2*id +
    h*ih``."""
    h = m.hidden
    if m.mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.heads * qk) if m.q_lora_rank else h * m.heads * qk
        attn = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
                + m.kv_lora_rank * m.heads * (m.qk_nope_head_dim + m.v_head_dim) + m.heads * m.v_head_dim * h)
    else:
        qd, kvd = m.heads * m.head_dim, m.kv_heads * m.head_dim
        attn = 2 * h * qd + 2 * h * kvd + (qd + 2 * kvd if m.qkv_bias else 0) + (2 * m.head_dim if m.qk_norm else 0)
    if m.index_heads:
        attn += (m.q_lora_rank or h) * m.index_heads * m.index_head_dim + h * m.index_head_dim \
            + 2 * m.index_head_dim + h * m.index_heads
    dense = attn + 2 * h
    expert = 0
    if i in m.moe_layers:
        dense += m.experts * h + (m.experts if m.router_bias else 0)
        expert = m.experts * 3 * h * m.moe_ffn
        if m.shared_ffn:
            dense += 3 * h * m.shared_ffn + (0 if m.router_bias else h)
    else:
        dense += 3 * h * m.ffn
    return LayerParams(dense, expert)


def mtp_layer_params(m: ModelShape) -> LayerParams:
    """One MTP layer (DeepSeek-V3's layout, which GLM-5 follows): a decoder layer of the model's last kind (MoE when
    the model has MoE layers) plus ``eh_proj`` (``2h -> h``) and the ``enorm``, ``hnorm`` and ``shared_head.norm``
    norms; the embedding and the output head are the main model's, shared."""
    base = layer_params(m, m.moe_layers[-1] if m.moe_layers else m.layers - 1)
    return LayerParams(base.dense + 2 * m.hidden * m.hidden + 3 * m.hidden, base.expert)


def param_count(m: ModelShape) -> int:
    """Total parameters: ``V*h`` embedding (+ ``V*h`` ``lm_head`` unless tied) + ``h`` final norm + the layers."""
    layers = (layer_params(m, i) for i in range(m.layers))
    return m.vocab * m.hidden * (1 if m.tied else 2) + m.hidden + sum(lp.dense + lp.expert for lp in layers)


def active_param_count(m: ModelShape) -> int:
    """Parameters a token passes through (routed experts counted ``experts_per_token`` times)."""
    return param_count(m) - len(m.moe_layers) * (m.experts - m.experts_per_token) * 3 * m.hidden * m.moe_ffn


# -------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Parallel layout and run settings (the slime/Megatron flag each mirrors in brackets)."""

    tp: int = 1                        # --tensor-model-parallel-size
    pp: int = 1                        # --pipeline-model-parallel-size
    cp: int = 1                        # --context-parallel-size
    ep: int = 1                        # --expert-model-parallel-size
    dp: int = 1                        # actor GPUs / (TP*PP*CP)
    max_tokens_per_gpu: int = 0        # --max-tokens-per-gpu (0: --micro-batch-size * --seq-length / CP)
    micro_batch_size: int = 1          # --micro-batch-size
    seq_length: int = 4096             # --seq-length: longest sequence (the eager s^2 term)
    num_microbatches: int = 0          # micro-batches per step (0: at least PP, i.e. a full 1F1B pipeline)
    param_dtype: str = "bf16"          # --bf16 / --fp16 / fp32
    grad_dtype: str = "fp32"           # fp32 main_grad (Megatron default); bf16 with --grad-reduce-in-bf16
    distributed_optimizer: bool = True  # --use-distributed-optimizer
    recompute: str = "none"            # --recompute-granularity full|selective (none: not given)
    attention: str = "flash"           # flash (fused attention) | eager (stores the s^2 scores)
    kernels: str = "fused"             # fused (TransformerEngine / MindSpeed) | cpu (slime_ascend.cpu.spec)
    dropout: bool = False              # attention/hidden dropout > 0 (masks saved)
    sequence_parallel: bool = True     # --sequence-parallel (slime's Megatron scripts pass it with TP > 1)
    critic: bool = False               # PPO critic train process
    reference: bool = True             # a reference model (--ref-load; KL or ref log-probs)
    rollout_tp: int = 1                # --rollout-num-gpus-per-engine
    kv_cache_tokens: int = 0           # KV pool tokens per engine (0: from mem_fraction * device_gib)
    mem_fraction: float = 0.8          # --sglang-mem-fraction-static
    device_gib: float = 64.0           # accelerator memory per device (Ascend 910B: 64 GiB)
    kv_dtype: str = "bf16"             # KV cache dtype (fp8 with --sglang-kv-cache-dtype fp8_e4m3)
    chunked_prefill_tokens: int = 8192  # SGLang --chunked-prefill-size
    running_requests: int = 256        # SGLang decode batch (logits rows)
    teachers: int = 0                  # OPD teacher engines
    teacher_tp: int = 0                # their engine TP (0: rollout_tp)
    sync_format: str = "none"          # weight-sync quantisation: none|fp8-block|int8-w8a8|int4-group
    qat: str = "none"                  # the qat plugin's fake-quant format: none|fp8-block|int8-w8a8|int4-group
    mtp_training: bool = False         # slime's --enable-mtp-training: the MTP layers train on the last stage
    rollout_mtp: bool = False          # the engines draft with the MTP layers (--sglang-speculative-algorithm NEXTN)
    sync_bucket_bytes: int = 512 * 1024**2  # --update-weight-buffer-size
    margin: float = 0.10               # allocator fragmentation margin, fraction of the role's peak

    def validate(self) -> None:
        """One ``ValueError`` naming the field (its CLI flag spelled with dashes) and the fix."""
        for low, names in ((1, ("tp", "pp", "cp", "ep", "dp", "micro_batch_size", "seq_length", "rollout_tp")),
                           (0, ("max_tokens_per_gpu", "kv_cache_tokens", "teachers", "teacher_tp", "num_microbatches",
                                "chunked_prefill_tokens", "running_requests", "sync_bucket_bytes"))):
            for name in names:
                v = getattr(self, name)
                if not isinstance(v, int) or v < low:
                    raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {v!r}. Fix: pass "
                                     f"{'0 or ' if low == 0 else ''}a positive integer")
        for name, allowed in (("param_dtype", ("bf16", "fp16", "fp32")), ("grad_dtype", ("fp32", "bf16", "fp16")),
                              ("recompute", RECOMPUTE), ("attention", ("flash", "eager")), ("kernels", KERNELS),
                              ("kv_dtype", ("bf16", "fp16", "fp32", "fp8")), ("sync_format", SYNC_FORMATS),
                              ("qat", SYNC_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not known. Fix: use one "
                                 f"of {', '.join(allowed)}")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"--mem-fraction {self.mem_fraction!r} must be in (0, 1). Fix: pass e.g. 0.8")
        if not self.device_gib > 0:
            raise ValueError(f"--device-gib {self.device_gib!r} must be > 0. Fix: pass the device memory in GiB")
        if not 0 <= self.margin < 1:
            raise ValueError(f"--margin {self.margin!r} must be in [0, 1). Fix: pass e.g. 0.1")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise ValueError(f"--ep {self.ep} must divide TP*CP*DP = {self.tp * self.cp * self.dp} (Megatron's expert "
                             f"data-parallel size). Fix: choose an --ep that divides it, or raise --dp")

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch per rank: slime's ``--max-tokens-per-gpu`` (per CP rank already: slime packs
        ``max_tokens_per_gpu * cp_size`` tokens per micro-batch, ``slime/utils/dp_schedule.py``), else
        ``micro_batch_size * seq_length / CP``."""
        if self.max_tokens_per_gpu:
            return self.max_tokens_per_gpu
        return max(1, self.micro_batch_size * self.seq_length // self.cp)


def check_layout_fits(m: ModelShape, lay: Layout) -> None:
    """Divisibility Megatron and SGLang insist on, as one ``ValueError`` with its fix."""
    if m.heads % lay.tp:
        raise ValueError(f"--tp {lay.tp} does not divide the model's {m.heads} attention heads. Fix: choose a "
                         f"--tp that divides {m.heads}")
    if lay.pp > m.layers:
        raise ValueError(f"--pp {lay.pp} exceeds the model's {m.layers} layers. Fix: choose --pp <= {m.layers}")
    if m.experts and m.experts % lay.ep:
        raise ValueError(f"--ep {lay.ep} does not divide the model's {m.experts} experts. Fix: choose an --ep that "
                         f"divides {m.experts}")
    if not m.experts and lay.ep > 1:
        raise ValueError(f"--ep {lay.ep} given for a dense model. Fix: drop --ep (or pass --ep 1)")
    if lay.kernels == "cpu" and (m.experts or m.mla or lay.tp > 1 or lay.cp > 1 or lay.attention != "flash"):
        raise ValueError("--kernels cpu is slime_ascend.cpu.spec: dense GQA models, TP = CP = 1, its SDPA attention. "
                         "Fix: use --kernels fused for this model or layout")
    if m.heads % lay.rollout_tp:
        raise ValueError(f"--rollout-tp {lay.rollout_tp} does not divide the model's {m.heads} heads. Fix: choose "
                         f"a --rollout-tp that divides {m.heads}")


# ----------------------------------------------------------------------------------------- formulas


def model_state_bytes_per_param(param_dtype: str, grad_dtype: str, dp_shard: int) -> dict[str, float]:
    """Megatron's model state per parameter (``docs/source/api-guide/dist_optimizer.md`` of Megatron-LM):

    ============================  ===================  ============================
    params / grads                non-distributed      distributed optimizer (DP d)
    fp16 params, fp16 grads       20                   4 + 16/d
    bf16 params, fp32 grads       18                   6 + 12/d
    fp32 params, fp32 grads       16                   8 + 8/d
    ============================  ===================  ============================

    i.e. params (2 or 4 B) + grads (``main_grad``: 4 B fp32, or 2 B with ``--grad-reduce-in-bf16``) stay
    whole on every DP rank; the fp32 main params (4 B, only when params are not fp32; with 16-bit grads also
    an fp32 main grad, 4 B) and Adam's ``exp_avg`` + ``exp_avg_sq`` (8 B) are sharded over ``dp_shard``
    (the DP x CP group; 1 without the distributed optimizer)."""
    p, g = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_dtype]
    main = 0.0 if param_dtype == "fp32" else 4.0
    main_grad = 4.0 if (g < 4 and param_dtype != "fp32") else 0.0
    return {"params": p, "grads": g, "main params": (main + main_grad) / dp_shard, "adam": 8.0 / dp_shard}


def layer_activation_terms(m: ModelShape, lay: Layout, moe: bool, e: float) -> dict[str, float]:
    """Saved activations of one layer, per token, in bytes, before TP division, by tensor (Megatron keeps
    these for backward). Generalises Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", Sec. 4.1), whose per-layer total for a GPT layer (``a*d = h``, ``ffn = 4h``, GeLU,
    dropout, 2-byte activations, no flash attention) is ``sbh(34 + 5as/h)``:

    attention ``11sbh + 5as^2b``: QKV input 2, Q and K 4, V 2, softmax output ``2as``, its dropout mask ``as``
    and dropout output ``2as``, output-projection input 2, dropout mask 1; MLP ``19sbh``: fc1 input 2, GeLU
    input 8, GeLU output 8, dropout mask 1; the two layer-norm inputs ``4sbh``.

    Here with the model's dims and ``e`` bytes per element: GQA ``q, k, v = e*(a*d + 2*g*d)``; Qwen3's q/k
    norms add their inputs; MLA saves its latents; SwiGLU saves fc1's output ``e*2*ffn`` (gate, up) and the
    activation output ``e*ffn``; flash attention saves the output (the projection input) and the fp32
    log-sum-exp ``4a`` instead of the ``s^2`` terms; MoE layers save the router input and, per routed token
    (``k`` per token), the permuted input ``e*h``, fc1 output ``e*2*moe_ffn`` and activation output
    ``e*moe_ffn``, plus the shared experts like a dense MLP. Keys ending in ``:rep`` are the terms that sequence
    parallelism shards (norm inputs, QKV/fc1 inputs, dropout masks: the paper's ``10sbh``); with TP but no SP
    they stay whole on each TP rank.

    ``Layout.kernels == "cpu"``: the unfused kernels of :mod:`slime_ascend.cpu.spec` (Megatron's local transformer),
    each checked with ``torch.autograd.graph.saved_tensors_hooks``: each RMSNorm (the two in
    ``NormColumnParallelLinear``, the q/k norms as ``torch.nn.RMSNorm``) saves its fp32 upcast and fp32
    normalised value, ``8`` bytes per element whatever the dtype; ``PackedSDPAttention`` repeats k and v to
    every head and SDPA saves q, k, v (``3*a*d``) and its own output (``a*d``) besides the packed output that
    the projection saves; Megatron's unfused RoPE keeps ``cos`` and ``sin`` of q and of k (``4*d``); the
    unfused SwiGLU (``silu(x0) * x1``) keeps fc1's output, the silu output and the product: ``4*ffn``."""
    h, a = m.hidden, m.heads
    cpu = lay.kernels == "cpu"
    t: dict[str, float] = {}
    t["norm inputs:rep"] = 2 * (8 * h if cpu else e * h)
    t["qkv input:rep"] = e * h
    if m.mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        t["mla latents"] = e * (2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_head_dim)
        t["q, k, v"] = e * (2 * a * qk + a * m.v_head_dim)
    elif cpu:
        t["q, k, v (k, v repeated to every head)"] = e * 3 * a * m.head_dim
        t["SDPA output"] = e * a * m.head_dim
        t["RoPE cos, sin (q and k)"] = 4 * e * m.head_dim
    else:
        t["q, k, v"] = e * (a * m.head_dim + 2 * m.kv_heads * m.head_dim)
    if m.qk_norm and not m.mla:
        t["q/k norm inputs"] = (8 if cpu else e) * (a * m.head_dim + m.kv_heads * m.head_dim)
    out_dim = a * (m.v_head_dim if m.mla else m.head_dim)
    if lay.attention == "eager" and lay.recompute == "none":
        s = lay.seq_length
        t["attention scores (s^2)"] = (2 * e if lay.dropout else e) * a * s + (a * s if lay.dropout else 0)
    elif lay.attention == "flash" and lay.recompute != "selective":
        t["flash log-sum-exp"] = 4 * a
    t["out-proj input"] = e * out_dim
    t["fc1 input:rep"] = e * h
    if moe:
        k = m.experts_per_token
        t["router logits"] = 4 * m.experts
        t["routed tokens (permuted input)"] = k * e * h
        t["expert fc1 out + act out"] = k * e * 3 * m.moe_ffn
        if m.shared_ffn:
            t["shared expert fc1 out + act out"] = e * 3 * m.shared_ffn
    else:
        t["fc1 out + act out"] = e * (4 if cpu else 3) * m.ffn
    if lay.dropout:
        t["dropout masks:rep"] = 2 * h
    return t


def layer_activation_bytes(m: ModelShape, lay: Layout, moe: bool, tokens: int) -> float:
    """One layer's saved activations on one rank for ``tokens`` tokens: the sharded terms / TP, the ``:rep``
    terms / TP under sequence parallelism (else whole), as Korthikanti et al. 2022 Table 2
    (``sbh/t * (34 + 5as/h)`` with TP + SP)."""
    e = DTYPE_BYTES[lay.param_dtype]
    total = 0.0
    for key, v in layer_activation_terms(m, lay, moe, e).items():
        total += v if (key.endswith(":rep") and not lay.sequence_parallel) else v / lay.tp
    return total * tokens


def stage_layers(m: ModelShape, pp: int) -> list[list[int]]:
    """Megatron's even split of the layers over pipeline stages (earlier stages take the remainder)."""
    base, extra = divmod(m.layers, pp)
    starts = [s * base + min(s, extra) for s in range(pp + 1)]  # s full stages and their extra layers before s
    return [list(range(starts[s], starts[s + 1])) for s in range(pp)]


# ------------------------------------------------------------------------------------------- ledger


@dataclass
class Entry:
    role: str
    name: str
    category: str
    bytes: float
    owner: str
    lifetime: str            # a phase of the role's process, or "whole run"
    where: str = "device"    # device | host
    formula: str = ""

    def live_in(self, phase: str) -> bool:
        return self.lifetime == WHOLE_RUN or self.lifetime == phase


@dataclass
class Ledger:
    model: ModelShape
    layout: Layout
    entries: list[Entry] = field(default_factory=list)
    processes: dict[str, str] = field(default_factory=dict)   # role -> process (reference -> actor)
    notes: list[str] = field(default_factory=list)

    def roles(self) -> list[str]:
        return list(dict.fromkeys(e.role for e in self.entries))

    def role_entries(self, role: str) -> list[Entry]:
        return [e for e in self.entries if e.role == role]

    def phases(self, role: str) -> tuple[str, ...]:
        proc = self.processes.get(role, role)
        return ENGINE_PHASES if proc.startswith(("rollout", "teacher")) else TRAIN_PHASES

    def _peak(self, entries: list[Entry], phases: tuple[str, ...], where: str) -> tuple[float, str]:
        sums = {ph: sum((e.bytes for e in entries if e.where == where and e.live_in(ph)), 0.0) for ph in phases}
        best = max(phases, key=sums.__getitem__)  # the first phase with the largest sum
        return sums[best], best

    def peak(self, role: str, where: str = "device") -> tuple[float, str]:
        """(bytes, phase): the largest sum of this role's objects live together in one phase."""
        return self._peak(self.role_entries(role), self.phases(role), where)

    @property
    def process_peaks(self) -> dict[str, float]:
        """Per process (the reference's objects counted in the actor's process)."""
        out: dict[str, float] = {}
        for proc in dict.fromkeys(self.processes.get(r, r) for r in self.roles()):
            entries = [e for e in self.entries if self.processes.get(e.role, e.role) == proc]
            out[proc] = self._peak(entries, self.phases(proc), "device")[0]
        return out

    def total(self, role: str, category: str | None = None, lifetime: str | None = None) -> float:
        return sum(e.bytes for e in self.role_entries(role)
                   if (category is None or e.category == category) and (lifetime is None or e.lifetime == lifetime))

    def to_dict(self) -> dict[str, Any]:
        roles = {}
        for r in self.roles():
            pk, ph = self.peak(r)
            host, _ = self.peak(r, "host")
            roles[r] = {
                "process": self.processes.get(r, r), "peak_bytes": int(pk), "peak_gib": round(pk / GIB, 3),
                "peak_phase": ph, "host_bytes": int(host),
                "entries": [{k: v for k, v in asdict(e).items() if k != "role"} | {"bytes": int(e.bytes)}
                            for e in self.role_entries(r)],
            }
        return {
            "model": asdict(self.model) | {"params": param_count(self.model),
                                           "active_params": active_param_count(self.model)},
            "layout": asdict(self.layout), "roles": roles,
            "process_peak_bytes": {k: int(v) for k, v in self.process_peaks.items()}, "notes": self.notes,
        }


def _adder(led: Ledger, role: str) -> Callable[..., None]:
    """``add(name, category, bytes, owner, lifetime, formula="", where="device")``: book one object of ``role``."""
    def add(name: str, cat: str, b: float, owner: str, life: str, formula: str = "", where: str = "device") -> None:
        led.entries.append(Entry(role, name, cat, float(b), owner, life, where, formula))
    return add


def _quantised_bytes(shapes: list[tuple[str, tuple[int, ...]]], fmt: str, base: float,
                     passthrough: bool = True) -> tuple[float, float]:
    """(payload bytes, scale bytes) of ``shapes`` in the sync format, as slime-ascend's quantisers write them
    (``slime_ascend/quant/schemes.py``): fp8-block 1 B + one fp32 scale per 128x128 tile; int8-w8a8 1 B + one
    fp32 scale per output row; int4-group two values per byte + one bf16 scale per 128-value group. Only the
    tensors of :func:`slime_ascend.quant.name_policy.is_default_quantized` are quantised; the rest keep
    ``base`` bytes per element (and no scales), or count nothing with ``passthrough=False`` (the funnel's
    quantised copy holds only the quantised tensors)."""
    from ..quant.name_policy import is_default_quantized

    payload = scales = 0.0
    for name, shape in shapes:
        n = math.prod(shape)
        if fmt == "none" or not is_default_quantized(name, len(shape)):
            payload += n * base if passthrough else 0
            continue
        rows, cols = shape[-2], shape[-1]
        lead = math.prod(shape[:-2])
        if fmt == "fp8-block":
            payload += n
            scales += 4 * lead * math.ceil(rows / 128) * math.ceil(cols / 128)
        elif fmt == "int8-w8a8":
            payload += n
            scales += 4 * lead * rows
        else:  # int4-group
            payload += n / 2
            scales += 2 * lead * rows * math.ceil(cols / 128)
    return payload, scales


def _rank_params(m: ModelShape, lay: Layout, layers: list[int], first: bool, last: bool,
                 value_head: bool = False) -> tuple[float, float]:
    """(dense params, expert params) held by one rank of the stage holding ``layers``: dense / TP, experts
    / EP; the embedding on the first stage, ``lm_head`` (or the critic's value head ``h``) and the final norm
    on the last (a tied embedding is held by both the first and the last stage when PP > 1)."""
    dense = expert = 0.0
    for i in layers:
        lp = layer_params(m, i)
        dense += lp.dense / lay.tp
        expert += lp.expert / lay.ep
    if first:
        dense += m.vocab * m.hidden / lay.tp
    if last:
        dense += m.hidden / lay.tp
        if value_head:
            dense += m.hidden
        elif not m.tied or lay.pp > 1:
            dense += m.vocab * m.hidden / lay.tp
        if lay.mtp_training and not value_head:  # Megatron puts the MTP block after the last stage's layers
            mtp = mtp_layer_params(m)
            dense += m.mtp_layers * mtp.dense / lay.tp
            expert += m.mtp_layers * mtp.expert / lay.ep
    return dense, expert


def _train_role(led: Ledger, role: str, m: ModelShape, lay: Layout, value_head: bool) -> tuple[float, bool]:
    """Entries of one Megatron train process (actor or critic) on its most loaded pipeline stage; returns that
    rank's parameter count and whether the stage is the last."""
    e = DTYPE_BYTES[lay.param_dtype]
    T = lay.tokens
    stages = stage_layers(m, lay.pp)
    n_mb = lay.num_microbatches or lay.pp

    def load(s: int) -> float:  # 1F1B: stage s holds min(PP - s, M) micro-batches
        dense, expert = _rank_params(m, lay, stages[s], s == 0, s == lay.pp - 1, value_head)
        acts = sum(layer_activation_bytes(m, lay, i in m.moe_layers, T) for i in stages[s]) * min(lay.pp - s, n_mb)
        return (dense + expert) * 18 + acts

    s = max(range(lay.pp), key=load)
    layers = stages[s]
    first, last = s == 0, s == lay.pp - 1
    dense, expert = _rank_params(m, lay, layers, first, last, value_head)
    inflight = min(lay.pp - s, n_mb)
    dp_dense = lay.dp * lay.cp if lay.distributed_optimizer else 1
    dp_expert = (lay.tp * lay.cp * lay.dp) // lay.ep if lay.distributed_optimizer else 1
    where = f"PP stage {s} of {lay.pp}" if lay.pp > 1 else "the one stage"
    led.notes.append(f"{role}: {where}, {dense + expert:,.0f} parameters per rank ({dense:,.0f} dense / TP {lay.tp}"
                     + (f", {expert:,.0f} expert / EP {lay.ep}" if expert else "") + f"); {T} tokens per micro-batch, "
                     f"{inflight} in flight")

    led.processes[role] = role
    add = _adder(led, role)
    # model state: dense parameters' optimizer state sharded over DP x CP, the experts' over expert DP
    bd = model_state_bytes_per_param(lay.param_dtype, lay.grad_dtype, dp_dense)
    bx = model_state_bytes_per_param(lay.param_dtype, lay.grad_dtype, dp_expert)
    for key, name, owner, formula in (
            ("params", f"params ({lay.param_dtype})", "Megatron DDP param buffer", f"P x {bd['params']:g} B"),
            ("grads", f"grads ({lay.grad_dtype} main_grad)", "Megatron DDP grad buffer", f"P x {bd['grads']:g} B"),
            ("main params", f"fp32 main params (shard 1/{dp_dense})", "Megatron DistributedOptimizer",
             f"P x 4 B / {dp_dense}"),
            ("adam", f"Adam exp_avg + exp_avg_sq (shard 1/{dp_dense})", "Megatron DistributedOptimizer",
             f"P x 8 B / {dp_dense}")):
        if bd[key]:  # only the fp32 main params can be 0 (fp32 params)
            add(name, "model state", dense * bd[key] + expert * bx[key], owner, WHOLE_RUN, formula)

    # saved activations
    per_layer = {i: layer_activation_bytes(m, lay, i in m.moe_layers, T) for i in layers}
    biggest = max(per_layer.values()) if per_layer else 0.0
    if lay.recompute == "full":
        inputs = len(layers) * e * m.hidden * T / lay.tp * inflight
        add("layer inputs (full recompute checkpoints)", "saved activations", inputs,
            "Megatron recompute (uniform, 1 layer)", "train step", "2sbh/t per layer (Korthikanti 2022 Sec. 5)")
        add("one layer's recomputed activations", "saved activations", biggest, "Megatron recompute", "train step",
            "one layer's full activations, during its backward")
    else:
        how = "34sbh/t per layer (selective)" if lay.recompute == "selective" else "sbh/t(34 + 5as/h) per layer"
        add(f"layer activations ({len(layers)} layers x {inflight} micro-batch{'es' if inflight > 1 else ''})",
            "saved activations", sum(per_layer.values()) * inflight, "autograd (Megatron layers)", "train step",
            f"Korthikanti 2022 generalised: {how}")
    if last and lay.mtp_training and not value_head:
        moe = bool(m.moe_layers)
        add(f"MTP layers' activations ({m.mtp_layers} x {inflight} micro-batch{'es' if inflight > 1 else ''})",
            "saved activations", m.mtp_layers * inflight * (layer_activation_bytes(m, lay, moe, T)
                                                            + 2 * e * m.hidden * T / lay.tp),
            "autograd (Megatron MTP block)", "train step",
            "one decoder layer's activations + the eh_proj input [emb; hidden] 2e*h/t, per MTP layer")
        add("MTP logits + softmax fp32 (the MTP loss input)", "saved activations",
            m.mtp_layers * 8 * m.vocab / lay.tp * T, "Megatron MTP loss (process_mtp_loss)", "train step",
            "8 x V/t per token per MTP layer")
    cpu = lay.kernels == "cpu"
    if first and not cpu:  # cpu: layer 0's first norm upcasts the embedding output and keeps only the copy
        add("embedding output", "saved activations", e * m.hidden * T / lay.tp * inflight, "autograd",
            "train step", "e*h per token (SP shard)")
    if last:
        if cpu:
            add("final norm (fp32 upcast + normalised) + output-layer input", "saved activations",
                (8 + e) * m.hidden * T, "autograd (torch.nn.RMSNorm, output layer)", "train step", "(8 + e) h per token")
        else:
            add("final norm input + output-layer input", "saved activations", e * m.hidden * T * (1 / lay.tp + 1),
                "autograd", "train step", "final norm input / TP + gathered output-layer input e*h")
        if value_head:
            add("values [tokens] fp32", "saved activations", 4 * T, "autograd (value head)", "train step")
        else:
            vt = m.vocab / lay.tp * T
            add("logits fp32 [tokens, vocab/TP] (the loss input)", "saved activations", 4 * vt,
                "Megatron Float16Module (fp32 output of the last stage)", "train step",
                "4 x V/t per token; the 16-bit logits are freed by the cast")
            add("softmax fp32 (saved for the log-prob backward)", "saved activations", 4 * vt,
                "slime _VocabParallelLogProbEntropy", "train step", "4 x V/t per token (exp_, div_ in place)")
            add("entropy temporary softmax x logits fp32", "operator workspace", 4 * vt,
                "slime sum_softmax_logits (not CUDA: einsum there)", "train step", "4 x V/t per token")
    # operator workspace: activation gradients in flight during backward
    add("activation-gradient temporaries (one layer's backward)", "operator workspace",
        2 * max(e * 3 * (m.ffn if not m.moe_layers else max(m.ffn, m.experts_per_token * m.moe_ffn)),
                e * m.hidden * 4) / lay.tp * T, "autograd backward", "train step",
        "2 x the largest per-token tensor of a layer (fc1 out) x tokens / TP")
    # communication
    if lay.tp > 1:
        add("sequence-parallel all-gather buffer", "communication buffers", e * m.hidden * T, "Megatron global "
            "memory buffer (SP all-gather)", "train step", "e*h per token, whole sequence")
    if lay.pp > 1:
        add("pipeline send/recv activations", "communication buffers", 2 * e * m.hidden * T / lay.tp,
            "Megatron p2p communication", "train step", "2 x e*h/t per token")
    if any(i in m.moe_layers for i in layers):
        add("MoE all-to-all dispatch/combine", "communication buffers",
            2 * e * m.hidden * m.experts_per_token * T / lay.tp, "Megatron MoE token dispatcher", "train step",
            "2 x k x e*h per token / TP")
    # live IO
    add("micro-batch inputs (tokens, masks, log-probs, advantages, returns)", "live IO", 32 * T,
        "slime train data (per micro-batch)", "train step", "8 B token id + 4 B loss mask + 5 fp32 per token")
    if lay.qat != "none":
        _qat_rows(led, add, m, lay, layers, inflight)
    # log-prob forward (slime recomputes old log-probs; no saved activations)
    if not value_head:
        add("forward transients (one layer) + logits fp32", "operator workspace",
            biggest + (e + 4) * m.vocab / lay.tp * T * (1 if last else 0), "slime compute_log_prob (no grad)",
            "log-prob forward", "one layer's activations + (e + 4) V/t per token")
    return dense + expert, last


QUANT_CHUNK_ELEMS = 1 << 20  # slime_ascend.quant._common.DEFAULT_CHUNK_ELEMS: the quantiser's fp32 staging rows


def qat_weights(m: ModelShape, lay: Layout, layers: list[int]) -> list[float]:
    """Elements, on one rank, of each weight of ``layers`` the ``qat`` plugin fake-quantises: the exporter's default
    name policy (:func:`slime_ascend.quant.name_policy.is_default_quantized`) over :func:`param_shapes`, dense
    weights / TP, routed experts whole on their EP rank (expert TP 1)."""
    from ..quant.name_policy import is_default_quantized

    wanted = {f"model.layers.{i}." for i in layers}
    out = []
    for name, shape in param_shapes(m):
        if is_default_quantized(name, len(shape)) and name[: name.index(".", len("model.layers.")) + 1] in wanted:
            out.append(math.prod(shape) / (1 if ".mlp.experts." in name else lay.tp))
    return out


def _qat_rows(led: Ledger, add: Callable[..., None], m: ModelShape, lay: Layout, layers: list[int],
              inflight: int) -> None:
    """The ``qat`` plugin's objects in a train process. The master weights are the params row above (the floating
    parameters, unchanged); each hooked linear's forward makes a fake-quantised copy (``e`` bytes per element) which
    autograd saves for the input gradient until that layer's backward, so a train step holds the stage's copies for
    every micro-batch in flight (with full recompute: one layer's, recomputed in its backward); making one copy
    takes int8 codes (1 B per element), its scales and the quantiser's fp32 staging rows. A forward-only pass holds one
    copy at a time."""
    e = DTYPE_BYTES[lay.param_dtype]
    weights = qat_weights(m, lay, layers)
    if not weights:
        return
    per_layer = [sum(qat_weights(m, lay, [i])) for i in layers]
    largest = max(weights)
    if lay.recompute == "full":
        saved, how = max(per_layer) * e, "one layer's quantised weights x e (recomputed in its backward)"
    else:
        saved, how = sum(weights) * e * inflight, f"quantised weights of the stage x e x {inflight} in flight"
    add(f"QAT fake-quant weights ({lay.qat}, {lay.param_dtype}) saved for backward", "saved activations", saved,
        "slime-ascend qat (autograd keeps each linear's fake-quantised weight)", "train step", how)
    scale = 4 / (128 * 128) if lay.qat == "fp8-block" else (4 / 128 if lay.qat == "int4-group" else 0.0)
    work = largest * (1 + scale) + 4 * min(largest, QUANT_CHUNK_ELEMS)
    formula = "largest weight: 1 B codes + scales + 4 B x min(weight, 2^20) fp32 staging"
    add(f"QAT quantiser temporaries ({lay.qat})", "operator workspace", work, "slime-ascend qat (quantize_int / "
        "quantize_fp8_block)", "train step", formula)
    add(f"QAT fake-quant copy of one weight + quantiser temporaries ({lay.qat})", "operator workspace",
        work + largest * e, "slime-ascend qat (no-grad forward)", "log-prob forward", formula + " + e x weight")
    led.notes.append(f"qat ({lay.qat}): {len(weights)} weights fake-quantised per rank; the master weights are the "
                     f"params row, each forward adds the fake-quantised copies")


def _engine_role(led: Ledger, role: str, m: ModelShape, lay: Layout, tp: int, sync: str) -> None:
    """One SGLang engine rank (rollout or teacher): weights / engine TP in the engine's format, KV cache,
    the DSA indexer's key cache, prefill workspace."""
    base = DTYPE_BYTES["bf16"]
    payload, scales = _quantised_bytes(param_shapes(m), sync, base)
    led.processes[role] = role
    add = _adder(led, role)
    weights = (payload + scales) / tp
    fmt = "bf16" if sync == "none" else f"{sync} + scales"
    add(f"weights ({fmt}) / engine TP {tp}", "model state", weights, "SGLang model runner", WHOLE_RUN,
        "sum over tensors of quantised bytes / TP")
    drafts = m.mtp_layers if lay.rollout_mtp and role == "rollout" else 0
    if drafts:  # the NEXTN/EAGLE draft: the MTP layers in bf16 beside the model, with a KV pool of their own
        mtp = mtp_layer_params(m)
        draft_w = drafts * (mtp.dense + mtp.expert) * base / tp
        add(f"MTP draft weights ({drafts} layer{'s' if drafts > 1 else ''}, bf16) / engine TP {tp}", "model state",
            draft_w, "SGLang speculative worker (NEXTN draft)", WHOLE_RUN, "MTP layer params x 2 B / TP")
        weights += draft_w
    kv_e = DTYPE_BYTES[lay.kv_dtype]
    if m.mla:
        kv_tok = m.layers * (m.kv_lora_rank + m.qk_rope_head_dim) * kv_e
        kv_formula = "layers x (kv_lora_rank + qk_rope_head_dim) x dtype per token (MLA latent, not sharded)"
    else:
        kv_tok = 2 * m.layers * math.ceil(m.kv_heads / tp) * m.head_dim * kv_e
        kv_formula = "2 x layers x ceil(kv_heads/TP) x head_dim x dtype per token"
    idx_tok = m.layers * (m.index_head_dim + 4) if m.index_heads else 0
    if lay.kv_cache_tokens:
        tokens = lay.kv_cache_tokens
        how = "--kv-cache-tokens"
    else:
        pool = lay.mem_fraction * lay.device_gib * GIB - weights
        if pool <= 0:
            raise ValueError(f"{role}: the weights ({weights / GIB:.1f} GiB per rank) do not fit in --mem-fraction "
                             f"{lay.mem_fraction} of --device-gib {lay.device_gib}. Fix: raise --rollout-tp "
                             f"(or --teacher-tp), or pass --kv-cache-tokens")
        tokens = int(pool // (kv_tok * (m.layers + drafts) / m.layers + idx_tok))
        how = f"(mem_fraction x device - weights) / bytes per token = {tokens:,} tokens"
    add(f"KV cache ({tokens:,} tokens, {lay.kv_dtype})", "live IO", tokens * kv_tok, "SGLang token-to-KV pool",
        WHOLE_RUN, f"{kv_formula}; {how}")
    if drafts:
        add(f"MTP draft KV cache ({tokens:,} tokens, {drafts} layer{'s' if drafts > 1 else ''})", "live IO",
            tokens * kv_tok * drafts / m.layers, "SGLang speculative worker's token-to-KV pool", WHOLE_RUN,
            "the main KV per token / layers x MTP layers")
    if idx_tok:
        add(f"DSA index key cache ({tokens:,} tokens, fp8 + fp32 scale)", "live IO", tokens * idx_tok,
            "SGLang NSA indexer key pool", WHOLE_RUN, "layers x (index_head_dim x 1 B + 4 B scale) per token")
    add("prefill workspace (one chunk, one layer)", "operator workspace",
        lay.chunked_prefill_tokens * base * (m.hidden * 2 + 3 * max(m.ffn, m.experts_per_token * m.moe_ffn) / tp
                                             + (m.heads + 2 * m.kv_heads) * m.head_dim / tp),
        "SGLang forward (chunked prefill)", "serving", "chunk x e x (2h + 3 ffn/TP + qkv/TP)")
    add("logits fp32 (decode batch)", "operator workspace", lay.running_requests * 4 * m.vocab / tp * 2,
        "SGLang sampler", "serving", "running requests x V/TP x 4 B x 2 (logits + probs)")


def _buckets(shapes: list[tuple[str, tuple[int, ...]]], lay: Layout) -> list[list[tuple[str, tuple[int, ...]]]]:
    """slime's weight-sync buckets: full-size (TP-gathered) bf16 tensors in order, up to
    ``--update-weight-buffer-size`` bytes each; a bucket is flushed when the next tensor would overflow it, so
    one tensor larger than the cap is a bucket of its own (``slime/backends/megatron_utils/update_weight/``)."""
    out: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        b = math.prod(shape) * 2
        if out[-1] and size + b > lay.sync_bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, shape))
        size += b
    return out


def build_ledger(config: dict[str, Any] | ModelShape, layout: Layout,
                 teacher_config: dict[str, Any] | ModelShape | None = None) -> Ledger:
    """The ledger of every role (see the module docstring) for ``config`` under ``layout``."""
    layout.validate()
    m = config if isinstance(config, ModelShape) else ModelShape.from_hf(config)
    check_layout_fits(m, layout)
    if (layout.mtp_training or layout.rollout_mtp) and not m.mtp_layers:
        flag = "--mtp-training" if layout.mtp_training else "--rollout-mtp"
        raise ValueError(f"{flag}: the model config has no MTP layers (num_nextn_predict_layers). Fix: drop {flag}, "
                         "or pass the config of a model with MTP (DeepSeek-V3, GLM-5)")
    led = Ledger(m, layout)
    e = DTYPE_BYTES[layout.param_dtype]
    actor_params, actor_last = _train_role(led, "actor", m, layout, value_head=False)
    add = _adder(led, "actor")
    # slime gathers every bucket to full size before any transport
    buckets = _buckets(param_shapes(m), layout)
    largest = max(buckets, key=lambda b: sum(math.prod(s) for _, s in b))  # in bf16; the rollout receives it too
    add("weight-sync bucket: TP/EP-gathered full-size bf16 tensors", "communication buffers",
        sum(math.prod(s) for _, s in largest) * 2, "slime update_weight (all-gather)", "weight sync",
        "max(--update-weight-buffer-size, largest tensor)")
    if layout.sync_format != "none":
        pb, sb = max(_quantised_bytes(b, layout.sync_format, 2, passthrough=False) for b in buckets)
        add(f"weight-sync bucket: {layout.sync_format} copy", "communication buffers", pb,
            "slime-ascend weight_sync funnel (quantize_params)", "weight sync", "bucket in the sync format")
        add(f"weight-sync bucket: {layout.sync_format} scales", "communication buffers", sb,
            "slime-ascend weight_sync funnel", "weight sync")
    if layout.reference:
        add = _adder(led, "reference")
        p = actor_params * e
        led.processes["reference"] = "actor"
        add(f"reference weights ({layout.param_dtype}, pinned host)", "model state", p,
            "slime TensorBackuper tag 'ref'", WHOLE_RUN, "actor rank's P x e", "host")
        add(f"actor weights backup ({layout.param_dtype}, pinned host)", "model state", p,
            "slime TensorBackuper tag 'actor'", WHOLE_RUN, "actor rank's P x e", "host")
        T = layout.tokens
        biggest = max((layer_activation_bytes(m, layout, i in m.moe_layers, T) for i in range(m.layers)), default=0)
        add("reference forward transients (one layer) + logits fp32", "operator workspace",
            biggest + ((e + 4) * m.vocab / layout.tp * T if actor_last else 0),
            "slime compute_log_prob (ref weights swapped in)", "log-prob forward",
            "one layer's activations + (e + 4) V/t per token")
        add("ref log-probs [tokens] fp32", "live IO", 4 * T, "slime rollout data", "log-prob forward")
    if layout.critic:
        _train_role(led, "critic", m, layout, value_head=True)
    _engine_role(led, "rollout", m, layout, layout.rollout_tp, layout.sync_format)
    pb, sb = _quantised_bytes(largest, layout.sync_format, 2)
    _adder(led, "rollout")("received weight bucket", "communication buffers", pb + sb,
                           "SGLang update_weights_from_tensor/disk", "weight sync", "one bucket in the sync format")
    if layout.teachers:
        tm = m if teacher_config is None else (
            teacher_config if isinstance(teacher_config, ModelShape) else ModelShape.from_hf(teacher_config))
        ttp = layout.teacher_tp or layout.rollout_tp
        if tm.heads % ttp:
            raise ValueError(f"--teacher-tp {ttp} does not divide the teacher's {tm.heads} heads. Fix: choose a "
                             f"--teacher-tp that divides {tm.heads}")
        for i in range(1, layout.teachers + 1):
            _engine_role(led, f"teacher-{i}", tm, layout, ttp, "none")
    # allocator margin: a fraction of each process's peak, booked on its main role
    for proc, pk in led.process_peaks.items():
        if layout.margin and pk:
            _adder(led, proc)(f"allocator margin ({layout.margin:.0%} of the peak)", "allocator margin",
                              pk * layout.margin, "PyTorch caching allocator (fragmentation, rounding)", WHOLE_RUN,
                              "margin x peak of the other objects")
    return led


def format_table(led: Ledger) -> str:
    """One table per role (object, category, owner, lifetime, GiB) with its peak."""
    m, lay = led.model, led.layout
    lines = [f"model: {m.model_type or 'decoder'} {param_count(m) / 1e9:.3f}e9 params"
             + (f" ({active_param_count(m) / 1e9:.3f}e9 active)" if m.experts else "")
             + f"; layers {m.layers}, hidden {m.hidden}, heads {m.heads}/{m.kv_heads}, vocab {m.vocab}",
             f"layout: TP {lay.tp} PP {lay.pp} CP {lay.cp} EP {lay.ep} DP {lay.dp}; {lay.tokens} tokens/micro-batch; "
             f"recompute {lay.recompute}; {lay.param_dtype} params, {lay.grad_dtype} grads; rollout TP "
             f"{lay.rollout_tp}; sync {lay.sync_format}",
             *(f"note: {note}" for note in led.notes)]
    for role in led.roles():
        rows = led.role_entries(role)
        w = max(len(e.name) for e in rows)
        wo = max(len(e.owner) for e in rows)
        lines.append("")
        proc = led.processes.get(role, role)
        lines.append(f"[{role}]" + (f" (in the {proc} process)" if proc != role else ""))
        lines.append(f"  {'object':<{w}}  {'category':<21}  {'owner':<{wo}}  {'lifetime':<16}  {'where':<6}  {'GiB':>9}")
        for e in rows:
            lines.append(f"  {e.name:<{w}}  {e.category:<21}  {e.owner:<{wo}}  {e.lifetime:<16}  {e.where:<6}  "
                         f"{e.bytes / GIB:>9.3f}")
        pk, ph = led.peak(role)
        host, _ = led.peak(role, "host")
        lines.append(f"  peak {role}: {pk / GIB:.3f} GiB on the device (phase: {ph})"
                     + (f"; {host / GIB:.3f} GiB pinned host" if host else ""))
    lines.append("")
    for proc, pk in led.process_peaks.items():
        lines.append(f"process peak {proc}: {pk / GIB:.3f} GiB")
    return "\n".join(lines)


__all__ = [
    "CATEGORIES", "Entry", "Layout", "Ledger", "ModelShape", "SYNC_FORMATS", "active_param_count", "build_ledger",
    "format_table", "layer_activation_bytes", "layer_activation_terms", "layer_params", "model_state_bytes_per_param",
    "param_count", "param_shapes", "stage_layers",
]
