"""Does vLLM's sqrt-softplus top-k routing kernel give a token the same routed weights
alone as inside a batch? Run on the GPU with a staged release importable:

    tools/gpu/run.sh python 0.20.2-v4 tools/gpu/hash_routing_probe.py

or with only the release's MoE library carried (``vllm/_moe_C.abi3.so`` from its
wheel; ``_moe_C_stable_libtorch.abi3.so`` from 0.24), loaded into the machine's torch:

    python3 tools/gpu/hash_routing_probe.py --library PATH --vllm VERSION

DeepSeek-V4 routes with ``_moe_C.topk_softplus_sqrt`` (through
``vllm._custom_ops.topk_hash_softplus_sqrt``): hash layers take their experts from a
token-id table, the others the top-k of the scores plus a bias; the chosen scores are
renormalised and scaled. For 8, 128 and 256 routed experts, both layer kinds and
float32 and bfloat16 router logits, this routes one batch of tokens at once and each
token alone, and prints one JSON line per case (then all as the suite's RESULT line):
the largest weight difference between the two, each against the same arithmetic in
PyTorch (float32), and whether the chosen experts agree. A kernel that mixes tokens
shows a batch-versus-alone difference where the reference shows none.
"""

from __future__ import annotations

import json
import sys

BATCH = 64  # four warps' worth at 8 float32 experts, if a warp routes 16 tokens
TOPK = 2
SCALE = 1.5  # the shrunken V4's routed_scaling_factor
VOCAB = 4096
EXPERTS = (8, 128, 256)  # the matrix's two models, and the real V4-Flash


def reference(logits, bias, tokens, table):
    """The routing in float32: sqrt(softplus(logit)), the experts from the table (hash
    layers) or the top-k of score plus bias, their scores renormalised and scaled."""
    import torch

    scores = torch.nn.functional.softplus(logits.float()).sqrt()
    if table is not None:
        ids = table[tokens.long()].long()
    else:
        ids = (scores + bias).topk(TOPK, dim=-1).indices
    chosen = scores.gather(-1, ids)
    return chosen / chosen.sum(-1, keepdim=True) * SCALE, ids


def route(ops, logits, bias, tokens, table):
    import torch

    rows = logits.shape[0]
    weights = torch.empty(rows, TOPK, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, TOPK, dtype=torch.int32, device=logits.device)
    token_expert = torch.empty(rows, TOPK, dtype=torch.int32, device=logits.device)
    ops.topk_hash_softplus_sqrt(
        weights, ids, token_expert, logits, True, SCALE, bias, tokens, table
    )
    return weights, ids.long()


def case(ops, experts: int, hashed: bool, dtype, device: str = "cuda") -> dict:
    import torch

    gen = torch.Generator(device=device).manual_seed(experts * 2 + hashed)
    logits = torch.randn(BATCH, experts, generator=gen, device=device).to(dtype)
    tokens = torch.randint(0, VOCAB, (BATCH,), generator=gen, device=device, dtype=torch.int32)
    table = bias = None
    if hashed:
        # TOPK distinct experts per token id
        scores = torch.rand(VOCAB, experts, generator=gen, device=device)
        table = scores.argsort(-1)[:, :TOPK].to(torch.int32).contiguous()
    else:
        bias = torch.randn(experts, generator=gen, device=device) * 0.1
    together, together_ids = route(ops, logits, bias, tokens, table)
    alone = [route(ops, logits[i : i + 1], bias, tokens[i : i + 1], table) for i in range(BATCH)]
    alone_weights = torch.cat([w for w, _ in alone])
    alone_ids = torch.cat([i for _, i in alone])
    expected, expected_ids = reference(logits, bias, tokens, table)

    def gap(a, b, a_ids, b_ids) -> float:
        # compare weights expert by expert: the kernel may order a token's experts
        # differently from topk()
        a_sorted, order_a = a_ids.sort(-1)
        b_sorted, order_b = b_ids.sort(-1)
        if not torch.equal(a_sorted, b_sorted):
            return float("nan")
        return (a.gather(-1, order_a) - b.gather(-1, order_b)).abs().max().item()

    return {
        "experts": experts,
        "hash_layer": hashed,
        "logits": str(dtype).removeprefix("torch."),
        "batch": BATCH,
        "batch_vs_alone": gap(together, alone_weights, together_ids, alone_ids),
        "batch_vs_reference": gap(together, expected, together_ids, expected_ids),
        "alone_vs_reference": gap(alone_weights, expected, alone_ids, expected_ids),
        "experts_agree": bool(
            torch.equal(together_ids.sort(-1).values, alone_ids.sort(-1).values)
            and torch.equal(together_ids.sort(-1).values, expected_ids.sort(-1).values)
        ),
    }


def all_cases(ops, device: str = "cuda") -> list[dict]:
    """Every expert count, layer kind and logit dtype, each printed as it comes."""
    import torch

    cases = []
    for experts in EXPERTS:
        for hashed in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                try:
                    cases.append(case(ops, experts, hashed, dtype, device))
                except Exception as error:  # one unsupported combination is a finding
                    name = str(dtype).removeprefix("torch.")
                    line = {"experts": experts, "hash_layer": hashed, "logits": name}
                    cases.append({**line, "error": f"{type(error).__name__}: {error}"})
                print(json.dumps(cases[-1]))
    return cases


class LoadedLibrary:
    """The kernel straight from a loaded ``_moe_C`` library: the same arguments, in
    the same order, as ``vllm._custom_ops.topk_hash_softplus_sqrt`` passes them."""

    def topk_hash_softplus_sqrt(self, *args) -> None:
        import torch

        torch.ops._moe_C.topk_softplus_sqrt(*args)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="a release's _moe_C library, instead of vllm")
    parser.add_argument("--vllm", help="the release the library is from (with --library)")
    args = parser.parse_args(argv)
    if args.library:
        if not args.vllm:
            parser.error("--library needs --vllm VERSION (the release it is from)")
        torch.ops.load_library(args.library)
        ops, version = LoadedLibrary(), args.vllm
    else:
        import vllm
        from vllm import _custom_ops as ops

        version = vllm.__version__
    cases = all_cases(ops)
    device = torch.cuda.get_device_name()
    print("RESULT " + json.dumps({"vllm": version, "device": device, "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
