"""Why w8a8 is not served: two forwards of one position, unquantized and w8a8, compared projection by projection.

transformers runs the real SmolLM2 (float32, CPU) over a prefix of --short tokens and over --long tokens that
start with it; causality says position short-1 must come out the same from both, up to float rounding. For the
unquantized model and for w8a8 (every decoder Linear a QuantizedLinear running the target's w8a8 arithmetic), it reports the largest difference of each projection's input and output at that position, the
first projection whose output differs by more than --jump, and the difference of the logits.

    python -m bench.w8a8_divergence [--short 17 --long 48 --seed 0]

Writes bench/results/w8a8-divergence-<hardware>.{md,json} (or --out-dir).
"""
from __future__ import annotations

import argparse

import torch

from bench import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.w8a8_divergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: SmolLM2-135M-Instruct from the packaged GGUF)")
    p.add_argument("--short", type=int, default=17)
    p.add_argument("--long", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="seeds the random prefix's token ids")
    p.add_argument("--jump", type=float, default=1e-3, help="an output difference this large counts as a hop")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    return p.parse_args(argv)


def trace(model, ids: torch.Tensor, short: int) -> tuple[list[dict], float]:
    """Per Linear of the decoder layers, the largest input and output differences at position short-1 between the
    forwards over ids[:, :short] and ids; and the largest logit difference there."""
    from target_svc.quantization import QuantizedLinear

    records: dict[str, list] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=name: records.setdefault(name, []).append(
                 (inp[0][0, short - 1].clone(), out[0, short - 1].clone())))
             for name, m in model.named_modules()
             if ".layers." in name and isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    with torch.no_grad():
        a = model(ids[:, :short]).logits[0, short - 1]
        b = model(ids).logits[0, short - 1]
    for h in hooks:
        h.remove()
    rows = [{"projection": name, "input_diff": (x1 - x2).abs().max().item(), "output_diff": (y1 - y2).abs().max().item()}
            for name, ((x1, y1), (x2, y2)) in records.items()]
    return rows, (a - b).abs().max().item()


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers

    from ddtree_serve.default_model import ensure_default_model
    from target_svc.quantization import QuantizedLinear

    path = args.model or str(ensure_default_model())
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    ids = torch.randint(min(100, vocab // 2), min(40000, vocab), (1, args.long),
                        generator=torch.Generator().manual_seed(args.seed))
    results = {}
    for mode in ("none", "w8a8"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if mode == "w8a8":   # every decoder Linear runs the target's w8a8 arithmetic (its PyTorch reference)
            for name in [n for n, m in model.named_modules() if ".layers." in n and isinstance(m, torch.nn.Linear)]:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, QuantizedLinear.from_linear(
                    model.get_submodule(name), backend="dequant", bits=8, act_bits=8))
        rows, logit_diff = trace(model, ids, args.short)
        first = next((r for r in rows if r["output_diff"] > args.jump), None)
        results[mode] = {"logit_diff": logit_diff, "first_hop": first, "projections": rows}
        print(f"{mode}: logits differ by {logit_diff:.3g}; first projection whose output differs by > {args.jump}: "
              + (f"{first['projection']} (input {first['input_diff']:.2g}, output {first['output_diff']:.2g})"
                 if first else "none"), flush=True)
    hw = common.hardware("cpu", "float32", None)
    data = {"command": common.command_line("bench.w8a8_divergence"), "date": common.now_utc(), "hardware": hw,
            "model": path, "short": args.short, "long": args.long, "seed": args.seed, "jump": args.jump,
            "results": results}
    table = common.md_table(["mode", "logits differ by", "first hop", "its input differs by", "its output by"],
                            [[m, f"{r['logit_diff']:.3g}", r["first_hop"]["projection"] if r["first_hop"] else "-",
                              f"{r['first_hop']['input_diff']:.2g}" if r["first_hop"] else "-",
                              f"{r['first_hop']['output_diff']:.2g}" if r["first_hop"] else "-"]
                             for m, r in results.items()])
    md = ["# w8a8: one position, two forwards", "", f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
          f"Model: {path}, float32 on the CPU ({hw['cpu_model']}); random prefix (seed {args.seed}); position "
          f"{args.short - 1} from a {args.short}-token and a {args.long}-token forward.", "", table]
    common.write_outputs(args.out_dir, f"w8a8-divergence-{common.hardware_tag(hw)}", data, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
