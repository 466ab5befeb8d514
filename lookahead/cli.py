"""Command line: ``lookahead generate "prompt"`` and ``lookahead bench --prompts FILE.jsonl``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

import torch

from .config import LookaheadConfig


def _add_lookahead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=15, help="W, columns of the lookahead window (default 15)")
    p.add_argument("--ngram", type=int, default=5, help="N, n-gram size (default 5)")
    p.add_argument("--guess", type=int, default=15, help="G, candidates verified per step (default 15)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _load(args):
    from .loading import load_default
    from .model import LlamaForCausalLM

    if args.model is None:
        return load_default(device=args.device)
    model = LlamaForCausalLM.from_pretrained(args.model, device=args.device)
    return model, _load_tokenizer(args.model)


def _encode(tokenizer, text: str, chat: bool) -> torch.Tensor:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def _config(args) -> LookaheadConfig:
    return LookaheadConfig(window=args.window, ngram=args.ngram, guess=args.guess)


class _TextStream:
    """Prints text as tokens arrive, decoding the whole tail so multi-token characters come out whole."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = ""
        self.out = out  # None: whatever sys.stdout is when text arrives

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return
        out = self.out or sys.stdout
        out.write(text[len(self.printed):])
        out.flush()
        self.printed = text


def cmd_generate(args) -> int:
    try:
        la = None if args.no_lookahead else _config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = _load(args)
    ids = _encode(tokenizer, args.prompt, chat=not args.raw)
    stream = None if args.json else _TextStream(tokenizer)
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=la, streamer=stream)
    s = out.stats
    new = out.sequences[0, ids.shape[1]:].tolist()
    if args.json:
        print(json.dumps({"text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
                          "new_tokens": s.new_tokens, "steps": s.steps, "compression": s.compression_ratio,
                          "seconds": s.seconds, "tokens_per_second": s.tokens_per_second,
                          "lookahead": None if la is None else {
                              "window": la.window, "ngram": la.ngram, "guess": la.guess}}))
    else:
        print()
        mode = "plain" if la is None else f"lookahead W={la.window} N={la.ngram} G={la.guess}"
        print(f"[{mode}] {s.new_tokens} tokens in {s.steps} steps: compression {s.compression_ratio:.2f}, "
              f"{s.tokens_per_second:.1f} tokens/s", file=sys.stderr)
    return 0


def read_prompts(path: str, tokenizer) -> list[torch.Tensor]:
    """Token ids of a prompt set: rows with ``turns`` are chat (``turns[0]``), rows with ``prompt`` raw text."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "turns" in row:
                rows.append(_encode(tokenizer, row["turns"][0], chat=True))
            elif "prompt" in row:
                rows.append(_encode(tokenizer, row["prompt"], chat=False))
            else:
                raise ValueError(f"{path}:{line_no}: a row needs 'turns' (chat) or 'prompt' (raw text)")
    return rows


def git_revision() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "git": git_revision()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def run_prompt_set(model, prompts, config: LookaheadConfig, max_new_tokens: int, desc: str = "") -> dict:
    """Run each prompt plainly and with lookahead; returns per-prompt rows and the set's summary."""
    from tqdm.auto import tqdm

    rows = []
    for ids in tqdm(prompts, desc=desc, unit="prompt", file=sys.stderr):
        ids = ids.to(model.device)
        plain = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=None)
        ours = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=config)
        rows.append({"prompt_tokens": ids.shape[1], "new_tokens": ours.stats.new_tokens,
                     "steps": ours.stats.steps, "compression": ours.stats.compression_ratio,
                     "seconds": ours.stats.seconds, "plain_seconds": plain.stats.seconds,
                     "identical": bool(torch.equal(plain.sequences, ours.sequences))})
    tok = sum(r["new_tokens"] for r in rows)
    summary = {
        "prompts": len(rows),
        "mean_compression": statistics.fmean(r["compression"] for r in rows) if rows else 0.0,
        "tokens_per_second": tok / sum(r["seconds"] for r in rows) if rows else 0.0,
        "plain_tokens_per_second": tok / sum(r["plain_seconds"] for r in rows) if rows else 0.0,
        "identical": sum(r["identical"] for r in rows),
    }
    return {"summary": summary, "rows": rows}


def cmd_bench(args) -> int:
    try:
        config = _config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = _load(args)
    result = {"machine": machine_info(args.device), "command": " ".join(sys.argv),
              "config": {"window": config.window, "ngram": config.ngram, "guess": config.guess},
              "max_new_tokens": args.max_new_tokens, "sets": {}}
    for path in args.prompts:
        prompts = read_prompts(path, tokenizer)[: args.limit]
        name = os.path.splitext(os.path.basename(path))[0]
        res = run_prompt_set(model, prompts, config, args.max_new_tokens, desc=name)
        result["sets"][name] = res
        s = res["summary"]
        print(f"{name}: {s['prompts']} prompts, compression {s['mean_compression']:.2f}, "
              f"{s['tokens_per_second']:.1f} tokens/s with lookahead vs {s['plain_tokens_per_second']:.1f} without, "
              f"{s['identical']}/{s['prompts']} identical")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookahead", description="Lookahead decoding for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, streaming it, and print a summary line")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--no-lookahead", action="store_true", help="plain autoregressive decoding")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_lookahead_args(g)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="run prompt sets with and without lookahead")
    b.add_argument("--prompts", nargs="+", required=True, help="JSONL files (rows with 'turns' or 'prompt')")
    b.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    b.add_argument("--out", default=None, help="write the results as JSON here")
    _add_lookahead_args(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
