"""``slime-ascend serve-torch``: the torch engine (:mod:`.engine`) served over SGLang's HTTP surface
(:mod:`slime_ascend.rollout.http_server`) until interrupted. ``--help`` answers before torch is imported."""

from __future__ import annotations

import logging
import socket
from typing import Any

from ...command import ArgumentParser
from ..http_server import (BoundedThreadingHTTPServer, add_server_flags, make_server, positive_float, positive_int,
                           serve_until_interrupted, server_options)
from . import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS_LIMIT, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOP_LOGPROBS,
               DEFAULT_MAX_WEIGHT_ANSWER_BYTES, DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT, DEFAULT_MAX_WEIGHT_VALUES)

from .prefix_cache import DEFAULT_MAX_ENTRIES as DEFAULT_PREFIX_CACHE_ENTRIES
from .prefix_cache import DEFAULT_MAX_TOKENS as DEFAULT_PREFIX_CACHE_TOKENS

__all__ = ["build_parser", "serve_torch"]


def _non_negative_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _device(text: str) -> str:
    import argparse

    from ..engine_device import check_name

    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on (host, port) with the server's accept-queue depth (as socketserver binds it)."""
    sock = socket.socket(BoundedThreadingHTTPServer.address_family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # http.server's allow_reuse_address
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _adopt(server: Any, listener: socket.socket) -> None:
    """``server`` (bound by :func:`make_server` to a port of its own) serves on ``listener`` instead, with the
    connections already queued there."""
    server.socket.close()
    server.socket = listener
    server.server_address = listener.getsockname()
    server.server_port = server.server_address[1]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="slime-ascend serve-torch",
        description="Serve a CPU torch+transformers model over SGLang's HTTP API (reference rollout engine).",
    )
    parser.add_argument("--model", default=None, help="HF safetensors checkpoint dir (default: tiny random Qwen3); a "
                        "*ForSequenceClassification checkpoint (a reward model) is served on POST /classify")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port (0 picks a free one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", type=_device, default="cpu",
                        help="where the weights, the KV cache and every forward live: cpu (default), cuda[:N], or "
                        "npu[:N] (torch_npu; SLIME_ASCEND_EMULATE_NPU=1: the emulated Ascend device, a test double); "
                        "answers are sampled on the host from each forward's logits")
    limits = parser.add_argument_group("limits (bounded work per request and per server)")
    limits.add_argument("--max-batch-size", type=positive_int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="most prompts in one /generate request (default %(default)s)")
    limits.add_argument("--max-prompt-tokens", type=positive_int, default=DEFAULT_MAX_PROMPT_TOKENS,
                        help="most prompt tokens in one /generate request, summed over a batch (default %(default)s)")
    limits.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                        help="highest sampling_params.max_new_tokens accepted (default %(default)s)")
    limits.add_argument("--max-top-logprobs", type=positive_int, default=DEFAULT_MAX_TOP_LOGPROBS,
                        help="most top-k log-prob entries in one answer: top_logprobs_num x scored and new "
                        "positions, over a batch (default %(default)s)")
    limits.add_argument("--max-weight-values", type=positive_int, default=DEFAULT_MAX_WEIGHT_VALUES,
                        help="most values in one /get_weights_by_name answer (default %(default)s)")
    limits.add_argument("--max-weight-answer-bytes", type=positive_int, default=DEFAULT_MAX_WEIGHT_ANSWER_BYTES,
                        help="most bytes of one /get_weights_by_name answer, its worst-case JSON size; more is a 413 "
                        "(default %(default)s)")
    limits.add_argument("--max-weight-bytes-in-flight", type=positive_int,
                        default=DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT,
                        help="most bytes of /get_weights_by_name answers being built or sent at once, over all "
                        "connections; more is a 503 with Retry-After (default %(default)s)")
    limits.add_argument("--max-total-tokens", type=positive_int, default=None, metavar="N",
                        help="the KV budget (SGLang's flag): running requests reserve their prompt plus max_new_tokens "
                        "and the next in arrival order waits until it fits (one above N runs alone); /v1/loads "
                        "reports it as max_total_num_tokens (default: no budget)")
    add_server_flags(limits)
    cache = parser.add_argument_group("prefix cache (KV of earlier requests, reused only under the weight version "
                                      "that computed them)")
    cache.add_argument("--prefix-cache-tokens", type=_non_negative_int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                       metavar="N", help="most KV positions kept across requests, LRU; 0 turns the cache off "
                       "(default %(default)s)")
    cache.add_argument("--prefix-cache-entries", type=positive_int, default=DEFAULT_PREFIX_CACHE_ENTRIES,
                       metavar="N", help="most cached prefixes (default %(default)s)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="every /generate answer carries each fed token's routed experts (an MoE model; SGLang's "
                        "flag, for slime's --use-rollout-routing-replay: slime's router drops the request's own)")
    parser.add_argument("--dump-dsa-index-sets", default=None, metavar="DIR",
                        help="write each request's DSA key sets, per layer and fed position, to DIR/rollout-*.pt (a "
                        "GLM-5 model; compared with the train side's by `slime-ascend dsa-index-sets`)")
    spec = parser.add_argument_group("speculative decoding (SGLang's flags: STANDALONE, a draft model; NEXTN / EAGLE, "
                                     "the checkpoint's own MTP layer)")
    spec.add_argument("--speculative-algorithm", default=None, choices=["STANDALONE", "NEXTN", "EAGLE"],
                      help="STANDALONE: a draft model proposes tokens; NEXTN / EAGLE: the checkpoint's own MTP layer "
                      "does (config.num_nextn_predict_layers), switched with the model by every weight update; one "
                      "forward of the served model verifies them: the kept tokens follow its distribution and carry "
                      "its log-probs")
    spec.add_argument("--speculative-draft-model-path", default=None, metavar="DIR",
                      help="STANDALONE: the draft model's checkpoint (same vocabulary); NEXTN / EAGLE: none, or the "
                      "served checkpoint itself")
    spec.add_argument("--speculative-eagle-topk", type=positive_int, default=None, metavar="1",
                      help="NEXTN / EAGLE: draft candidates per step; the engine drafts a chain (1)")
    spec.add_argument("--speculative-num-steps", type=positive_int, default=None, metavar="K",
                      help="tokens the draft proposes per verifying forward")
    spec.add_argument("--speculative-num-draft-tokens", type=positive_int, default=None, metavar="N",
                      help="SGLang's count of verified tokens; for a chain of K steps it is K + 1 (checked)")
    sync = parser.add_argument_group("weight sync over a process group (/update_weights_from_distributed)")
    sync.add_argument("--weight-group-timeout", type=positive_float, default=None, metavar="S",
                      help="seconds to join a weight-update group (one deadline for the whole join), and for one "
                      "bucket's tensors to arrive; > 0 (default 120); a broadcast that breaks off leaves the old "
                      "version serving")
    sync.add_argument("--keep-received-weights", default=None, metavar="DIR",
                      help="also write each version that served, as received (the bytes on the wire), to "
                      "DIR/weight_vNNNNNN/model.safetensors")
    return parser


def _speculative(args: Any) -> dict[str, Any]:
    """The engine's speculative-decoding arguments from SGLang's flags, refused in one line when they disagree."""
    from ...command import UserError

    given = [args.speculative_draft_model_path, args.speculative_num_steps, args.speculative_num_draft_tokens,
             args.speculative_eagle_topk]
    algorithm = args.speculative_algorithm
    if algorithm is None:
        if any(v is not None for v in given):
            raise UserError("--speculative-draft-model-path / --speculative-num-steps / --speculative-num-draft-tokens "
                            "/ --speculative-eagle-topk need --speculative-algorithm (STANDALONE, NEXTN or EAGLE)")
        return {}
    if args.speculative_num_steps is None:
        raise UserError(f"--speculative-algorithm {algorithm} needs --speculative-num-steps K")
    if algorithm == "STANDALONE":
        if args.speculative_draft_model_path is None:
            raise UserError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path DIR and "
                            "--speculative-num-steps K")
        if args.speculative_eagle_topk is not None:
            raise UserError("--speculative-eagle-topk is NEXTN / EAGLE's; STANDALONE drafts a chain. Fix: drop it")
    elif args.speculative_eagle_topk not in (None, 1):
        raise UserError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: the engine drafts one chain. Fix: "
                        "--speculative-eagle-topk 1 (slime's GLM-5 scripts' value), or leave it out")
    if args.speculative_num_draft_tokens not in (None, args.speculative_num_steps + 1):
        raise UserError(f"--speculative-num-draft-tokens {args.speculative_num_draft_tokens} with "
                        f"--speculative-num-steps {args.speculative_num_steps}: a chain of K steps verifies K + 1 "
                        f"tokens. Fix: --speculative-num-draft-tokens {args.speculative_num_steps + 1}, or leave it out")
    return {"speculative_algorithm": algorithm, "speculative_draft_model_path": args.speculative_draft_model_path,
            "speculative_num_steps": args.speculative_num_steps}


def _check_start(model: str | None) -> None:
    """What would fail inside a loader, named first in one line (UserError): a transformers outside the range or
    beside a leftover ``kernels``, a checkpoint directory that is missing or holds a truncated or foreign shard."""
    from ...command import UserError
    from ...compat import transformers_stack
    from ...opd.safetensors_dir import validate_safetensors_dir

    transformers_stack.check()
    if model is None:  # the built-in tiny model
        return
    try:
        validate_safetensors_dir(model)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"--model {model}: {exc}. Fix: pass a checkpoint directory with its *.safetensors shards "
                        "(write or download it again if a shard is truncated)") from None


def serve_torch(argv: list[str] | None = None) -> int:
    """CLI entry: ``slime-ascend serve-torch --model DIR --host 127.0.0.1 --port PORT``: load the
    torch engine and serve it until interrupted (a reward-model checkpoint: on ``/classify``,
    :mod:`.reward_model`)."""
    args = build_parser().parse_args(argv)  # before torch is imported: --help answers at once
    _check_start(args.model)
    # listening before torch is imported and the model loads: a client that connects meanwhile waits in the
    # accept queue for its answer instead of being refused (a launcher need not poll until the load is done)
    speculative = _speculative(args)
    reward = _reward_model_start(args)
    listener = _listen(args.host, args.port, args.backlog)
    if not logging.getLogger().handlers:  # the engine's own events (weight updates) on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if reward:
        from .reward_model import RewardModelEngine

        engine = RewardModelEngine(args.model, dtype=args.dtype, device=args.device,
                                   max_batch_size=args.max_batch_size, max_prompt_tokens=args.max_prompt_tokens)
        return _serve(engine, args, listener)
    from .engine import TorchEngine

    engine = TorchEngine(model_path=args.model, dtype=args.dtype, seed=args.seed,
                             max_batch_size=args.max_batch_size, max_prompt_tokens=args.max_prompt_tokens,
                             max_new_tokens=args.max_new_tokens, max_top_logprobs=args.max_top_logprobs,
                             max_weight_values=args.max_weight_values,
                             max_weight_answer_bytes=args.max_weight_answer_bytes,
                             max_weight_bytes_in_flight=args.max_weight_bytes_in_flight,
                             prefix_cache_tokens=args.prefix_cache_tokens,
                             prefix_cache_entries=args.prefix_cache_entries,
                             enable_return_routed_experts=args.enable_return_routed_experts,
                             dump_dsa_index_sets=args.dump_dsa_index_sets, device=args.device,
                             max_total_tokens=args.max_total_tokens, **speculative)
    if args.weight_group_timeout is not None or args.keep_received_weights is not None:
        engine.configure_weight_group(timeout_s=args.weight_group_timeout, keep_dir=args.keep_received_weights)
    return _serve(engine, args, listener)


def _reward_model_start(args: Any) -> bool:
    """Whether ``--model`` is a reward model (``*ForSequenceClassification``: served on ``/classify``); the
    generating engine's options it cannot honour are refused in one line."""
    from ...command import UserError
    from .reward_model import is_reward_checkpoint

    if not is_reward_checkpoint(args.model):
        return False
    given = [flag for flag, on in (("--enable-return-routed-experts", args.enable_return_routed_experts),
                                   ("--max-total-tokens", args.max_total_tokens is not None),
                                   ("--speculative-algorithm", args.speculative_algorithm is not None),
                                   ("--dump-dsa-index-sets", args.dump_dsa_index_sets is not None),
                                   ("--weight-group-timeout", args.weight_group_timeout is not None),
                                   ("--keep-received-weights", args.keep_received_weights is not None)) if on]
    if given:
        raise UserError(f"--model {args.model} is a reward model (served on /classify); {', '.join(given)} "
                        "apply to a generating model only. Fix: drop them")
    return True


def _serve(engine: Any, args: Any, listener: socket.socket) -> int:
    server = make_server(engine, host=args.host, port=0, **server_options(args))
    _adopt(server, listener)
    bound_host, bound_port = server.server_address[:2]
    print(f"torch engine serving {engine.server_info()['model_path']} on {engine.device} at "
          f"http://{bound_host}:{bound_port}", flush=True)
    serve_until_interrupted(server)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(serve_torch())
