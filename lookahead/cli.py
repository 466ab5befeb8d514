"""Command line: ``lookahead generate "prompt"``, ``lookahead batch FILE.jsonl``, ``lookahead chat``, ``lookahead
convert DIR`` and ``lookahead bench --prompts FILE.jsonl``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

import torch

from .arguments import check_repetition_penalty, resolve_generate_arguments
from .config import LookaheadConfig
from .loading import DTYPES


class CliError(Exception):
    """A failure reported as one line on stderr (exit status 2 for bad options, 1 otherwise)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``lookahead: error: ...``."""

    def error(self, message):
        raise CliError(message, status=2)


def device_tree_arg(text: str):
    """``--device-tree``'s value: an int >= 0 or ``auto`` (``LookaheadConfig.device_tree``)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0 or 'auto', got {text!r}")
    return value


def _add_lookahead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=None,
                   help="W, columns of the lookahead window (default: chosen from the step budget)")
    p.add_argument("--ngram", type=int, default=None, help="N, n-gram size (default: chosen from the step budget)")
    p.add_argument("--guess", type=int, default=None, help="G, continuations per pool key (default: chosen)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="cap on the tokens one step feeds (default: sized from the device's measured cost)")
    p.add_argument("--device-tree", type=device_tree_arg, default=0, metavar="N",
                   help="CUDA: every step verifies a fixed tree of N nodes read on the GPU from successor tables kept "
                        "there, with no tree built on the host; 'auto': N sized for the batch from the GPU's measured "
                        "step costs (default 0: off)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--model", default=None,
                   help="Hugging Face directory, .gguf file or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype (default float32)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run each step eagerly instead of replaying captured CUDA graphs (for debugging)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: torch's, one a core); on a machine busy with other work, fewer than "
                        "its cores keeps decoding from stalling on threads that wait for a core")


# generate's sampling flags: (flag, type, what it does, its value when neither the call nor the model sets it)
_SAMPLING_FLAGS = (
    ("--temperature", float, "sampling temperature", "1.0"),
    ("--top-h", float, "keep the likeliest tokens while their entropy stays within this fraction of the top "
                       "100's", "off"),
    ("--top-k", int, "keep the k most likely tokens, 0: all", "50 as in transformers"),
    ("--top-p", float, "nucleus sampling mass", "1.0: off"),
    ("--min-p", float, "drop tokens less likely than this fraction of the likeliest", "off"),
    ("--typical-p", float, "locally typical sampling's mass", "1.0: off"),
    ("--epsilon-cutoff", float, "drop tokens less likely than this", "off"),
    ("--eta-cutoff", float, "eta sampling's cutoff", "off"),
)


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """generate's and chat's options: plain or sampled decoding, then the lookahead and model options."""
    p.add_argument("--no-lookahead", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    for flag, kind, what, unset in _SAMPLING_FLAGS:
        p.add_argument(flag, type=kind, default=None,
                       help=f"{what} (default: the model's generation config's, else {unset})")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator (default: random)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition penalty, greedy or sampled (> 1 discourages repeats; default: the "
                        "model's generation config's, else none)")
    p.add_argument("--min-new-tokens", type=int, default=None,
                   help="no end-of-sequence token before this many new tokens (default: the model's generation "
                        "config's, else 0)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None, metavar="N",
                   help="never repeat an n-gram of N tokens (0: off; default: the model's generation config's, else "
                        "off)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the answer right after the token that completes TEXT (repeatable; transformers' "
                        "stop_strings)")
    _add_lookahead_args(p)


def _device(args) -> str:
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise CliError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)", status=2) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__})",
                       status=2)
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {name}: only cpu and cuda devices are supported", status=2)
    return name


def _load(args, decoding: bool = True):
    from .loading import from_pretrained, is_hub_id, load_default, load_tokenizer, local_path

    threads = getattr(args, "threads", None)  # the command owns its process: torch's thread count is its own
    _check_at_least_one("--threads", threads)
    if threads is not None:
        torch.set_num_threads(threads)
    dtype = DTYPES[args.dtype]
    if decoding and dtype != torch.float32 and torch.device(args.device).type == "cpu":
        # Said, not refused: a user may want the other dtype's numbers. Measured on this project's 2-core Zen 5:
        # 57 against 237 tokens/s (bench/MEASUREMENTS.md, "Other dtypes on a CPU").
        print(f"lookahead: note: --dtype {args.dtype} on a CPU runs through torch's kernels, about 4x slower than "
              f"float32 (our C++ ops)", file=sys.stderr)
    if args.model is None:
        try:
            return load_default(dtype=dtype, device=args.device)
        except ValueError as err:
            raise CliError(f"cannot load the default model: {err}") from None
    if not os.path.exists(args.model) and not is_hub_id(args.model):
        raise CliError(f"--model {args.model}: no such file or directory")
    if os.path.exists(args.model) and not os.access(args.model, os.R_OK):
        raise CliError(f"--model {args.model}: not readable (permission denied)")
    try:
        path = local_path(args.model)  # a Hub id's snapshot, fetched once for the weights and the tokenizer
        model = from_pretrained(path, dtype=dtype, device=args.device)
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError) as err:
        raise CliError(f"cannot load --model {args.model}: {err}") from None
    return model, tokenizer


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a conversation through the tokenizer's chat template, ready for the assistant's turn."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def _encode(tokenizer, text: str, chat: bool) -> torch.Tensor:
    ids = chat_ids(tokenizer, [{"role": "user", "content": text}]) if chat else tokenizer(text)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def _config(args) -> LookaheadConfig:
    try:
        config = LookaheadConfig(window=args.window, ngram=args.ngram, guess=args.guess,
                                 max_step_tokens=args.max_step_tokens, device_tree=args.device_tree)
    except ValueError as err:
        raise CliError(str(err), status=2) from None
    if config.device_tree and (torch.device(_device(args)).type != "cuda" or args.no_cuda_graphs):
        raise CliError("--device-tree reads its trees inside the step's CUDA graph: it needs a CUDA device and "
                       "CUDA graphs (drop --no-cuda-graphs)", status=2)
    return config


def _describe(la: LookaheadConfig | None) -> str:
    if la is None:
        return "plain"
    parts = [f"{k}={v}" for k, v in (("W", la.window), ("N", la.ngram), ("G", la.guess),
                                     ("max-step-tokens", la.max_step_tokens),
                                     ("device-tree", la.device_tree or None)) if v is not None]
    return "lookahead " + (" ".join(parts) if parts else "auto")


def _print_summary(la: LookaheadConfig | None, s, more: str = "") -> None:
    """Ends the streamed text's line, then the call's summary on stderr."""
    print()
    print(f"[{_describe(la)}] {s.new_tokens} tokens in {s.steps} steps: compression {s.compression_ratio:.2f}, "
          f"{s.tokens_per_second:.1f} tokens/s{more}", file=sys.stderr)


def _sampling(args) -> dict:
    """generate's sampling keywords (greedy unless --do-sample, whatever the model's generation config says);
    errors before the model is loaded."""
    processing = {}
    if args.repetition_penalty is not None:
        try:
            processing = {"repetition_penalty": check_repetition_penalty(args.repetition_penalty)}
        except ValueError as err:
            raise CliError("--" + str(err).replace("_", "-"), status=2) from None
    if args.min_new_tokens is not None:
        if args.min_new_tokens < 0:
            raise CliError(f"--min-new-tokens must be >= 0, got {args.min_new_tokens}", status=2)
        processing["min_new_tokens"] = args.min_new_tokens
    if args.no_repeat_ngram_size is not None:
        if args.no_repeat_ngram_size < 0:
            raise CliError(f"--no-repeat-ngram-size must be >= 0 (0: off), got {args.no_repeat_ngram_size}",
                           status=2)
        processing["no_repeat_ngram_size"] = args.no_repeat_ngram_size
    if args.stop is not None and not all(args.stop):
        raise CliError("--stop needs a non-empty TEXT", status=2)
    names = [flag[2:].replace("-", "_") for flag, *_ in _SAMPLING_FLAGS]
    flags = {name: getattr(args, name) for name in names}
    given = {name: value for name, value in flags.items() if value is not None}
    if not args.do_sample:
        if given:
            named = ", ".join("--" + name.replace("_", "-") for name in given)
            raise CliError(f"{named} {'needs' if len(given) == 1 else 'need'} --do-sample (greedy decoding "
                           f"ignores {'it' if len(given) == 1 else 'them'})", status=2)
        return {"do_sample": False, **processing}
    from .sampling import SamplingParams

    try:
        SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **given})
    except ValueError as err:
        raise CliError(str(err).replace("SamplingParams.", "--").replace("top_", "top-").replace("min_", "min-")
                       .replace("typical_", "typical-").replace("_cutoff", "-cutoff"), status=2) from None
    return dict(do_sample=True, **given, **processing)


def _resolved(model, ids, sampling: dict):
    """The arguments generate resolves for this call (given flags over the model's generation config over
    transformers' defaults): the very resolution the call makes."""
    given = {k: v for k, v in sampling.items() if k != "generator"}
    extra = {k: given.pop(k) for k in ("repetition_penalty", "min_new_tokens", "min_p", "typical_p", "epsilon_cutoff",
                                       "eta_cutoff", "top_h", "no_repeat_ngram_size") if k in given}
    return resolve_generate_arguments(ids, model_generation_config=model.generation_config, extra=extra, **given)


def _stops(args, tokenizer) -> dict:
    """generate's stop-string keywords for ``--stop``."""
    return {"stop_strings": args.stop, "tokenizer": tokenizer} if args.stop else {}


def _check_at_least_one(option: str, value: int | None) -> None:
    """An option counting something (``None``: unset) must be at least 1."""
    if value is not None and value < 1:
        raise CliError(f"{option} must be >= 1, got {value}", status=2)


def _check_max_new_tokens(args) -> None:
    _check_at_least_one("--max-new-tokens", args.max_new_tokens)


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
    la = None if args.no_lookahead else _config(args)
    sampling = _sampling(args)
    _check_max_new_tokens(args)
    args.device = _device(args)
    model, tokenizer = _load(args)
    ids = _encode(tokenizer, args.prompt, chat=not args.raw)
    seed = _sampling_generator(sampling, args.seed, model.device)
    stream = None if args.json else _TextStream(tokenizer)
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=la, streamer=stream,
                         cuda_graphs=_cuda_graphs(args), **_stops(args, tokenizer), **sampling)
    s = out.stats
    new = out.sequences[0, ids.shape[1]:].tolist()
    if args.json:
        used = _resolved(model, ids, sampling)
        print(json.dumps({"text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
                          "new_tokens": s.new_tokens, "steps": s.steps, "compression": s.compression_ratio,
                          "seconds": s.seconds, "tokens_per_second": s.tokens_per_second,
                          "device": str(model.device), "dtype": args.dtype,
                          "sampling": None if not used.do_sample else {
                              "temperature": used.temperature, "top_k": used.top_k, "top_p": used.top_p,
                              "min_p": used.min_p, "typical_p": used.typical_p,
                              "epsilon_cutoff": used.epsilon_cutoff, "eta_cutoff": used.eta_cutoff,
                              "top_h": used.top_h, "seed": seed},
                          "repetition_penalty": used.repetition_penalty, "min_new_tokens": used.min_new_tokens,
                          "no_repeat_ngram_size": used.no_repeat_ngram_size,
                          "lookahead": None if la is None else {
                              "window": la.window, "ngram": la.ngram, "guess": la.guess,
                              "max_step_tokens": la.max_step_tokens, "device_tree": la.device_tree}}))
    else:
        _print_summary(la, s)
    return 0


def cmd_batch(args) -> int:
    """Every prompt of a JSONL file (rows with ``turns``: chat, ``prompt``: raw text) in one ``generate`` call of at
    most ``--max-batch-size`` rows at once; one JSON line per prompt, in the file's order."""
    la = None if args.no_lookahead else _config(args)
    sampling = _sampling(args)
    _check_max_new_tokens(args)
    _check_at_least_one("--max-batch-size", args.max_batch_size)
    _check_at_least_one("--limit", args.limit)
    if not os.path.isfile(args.prompts):
        raise CliError(f"{args.prompts}: no such file", status=2)
    args.device = _device(args)
    model, tokenizer = _load(args)
    try:
        prompts = [ids[0] for ids in read_prompts(args.prompts, tokenizer)[: args.limit]]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise CliError(f"{args.prompts}: {err}") from None
    if not prompts:
        raise CliError(f"{args.prompts}: no prompts")
    _sampling_generator(sampling, args.seed, model.device)
    from tqdm.auto import tqdm

    from .memory import DraftMemory

    # A file's prompts write alike: each finished row's text is guessed from by the rows still running.
    memory = None if args.no_draft_memory or la is None else DraftMemory()
    with tqdm(total=len(prompts), desc="prompts", unit="prompt", file=sys.stderr, leave=False) as bar:
        out = model.generate(prompts, max_new_tokens=args.max_new_tokens, lookahead=la,
                             max_batch_size=args.max_batch_size, cuda_graphs=_cuda_graphs(args),
                             _on_finish=bar.update, draft_memory=memory, **_stops(args, tokenizer), **sampling)
    L = max(p.numel() for p in prompts)
    lines = []
    for b, row in enumerate(out.stats.rows):
        new = out.sequences[b, L: L + row.new_tokens].tolist()
        lines.append(json.dumps({"index": b, "text": tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
                                 "new_tokens": row.new_tokens, "steps": row.steps}))
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(line + "\n" for line in lines))
    else:
        print("\n".join(lines))
    rows = min(len(prompts), args.max_batch_size or len(prompts))
    s = out.stats
    print(f"[{_describe(la)}] {len(prompts)} prompts, at most {rows} rows at once: {s.new_tokens} tokens in "
          f"{s.steps} steps, {s.tokens_per_second:.1f} tokens/s", file=sys.stderr)
    return 0


def _sampling_generator(sampling: dict, seed: int | None, device) -> int | None:
    """Adds a seeded generator to ``sampling`` (sampled decoding only); returns its seed."""
    if not sampling["do_sample"]:
        return None
    generator = torch.Generator(device=device)
    sampling["generator"] = generator
    return generator.manual_seed(seed).initial_seed() if seed is not None else generator.seed()


CHAT_HELP = ("an empty line is skipped, /reset forgets the conversation, /help says this, /exit or Ctrl-D (end of "
             "input) ends it")


def cmd_chat(args) -> int:
    """Turns read from stdin, one line each; the model's answers streamed, each with a summary line on stderr.

    The whole conversation goes through the chat template every turn; the keys and values of the tokens it
    shares with the last turn's are reused (a :class:`~lookahead.prompt_cache.PromptCache`), so a turn prefills
    only what is new. A turn that would not fit the model's context is refused, and ``/reset`` starts over.
    """
    from .prompt_cache import PromptCache

    la = None if args.no_lookahead else _config(args)
    sampling = _sampling(args)
    _check_max_new_tokens(args)
    args.device = _device(args)
    model, tokenizer = _load(args)
    if not getattr(tokenizer, "chat_template", None):
        raise CliError("the model's tokenizer has no chat template; chat needs one (use generate --raw)")
    _sampling_generator(sampling, args.seed, model.device)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    kept = PromptCache()
    interactive = sys.stdin.isatty()
    if interactive:
        try:  # line editing and history for input(), where the platform has it
            import readline  # noqa: F401
        except ImportError:
            pass
        print(f"lookahead chat: {CHAT_HELP}.", file=sys.stderr)
    context = model.config.max_position_embeddings
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                break
        else:
            line = sys.stdin.readline()
            if not line:
                break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/help":
            print(f"lookahead chat: {CHAT_HELP}.", file=sys.stderr)
            continue
        if text == "/reset":
            history = list(start)
            kept.clear()
            print("(the conversation starts over)", file=sys.stderr)
            continue
        turn = history + [{"role": "user", "content": text}]
        ids = chat_ids(tokenizer, turn)
        if len(ids) + args.max_new_tokens > context:
            print(f"(the conversation is {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} it would "
                  f"pass the model's context of {context}: /reset to start over)", file=sys.stderr)
            continue
        ids = torch.tensor([ids], dtype=torch.long)
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=la, streamer=_TextStream(tokenizer),
                             cuda_graphs=_cuda_graphs(args), prompt_cache=kept, **_stops(args, tokenizer), **sampling)
        answer = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        history = turn + [{"role": "assistant", "content": answer}]
        _print_summary(la, out.stats, f"; {out.stats.reused_tokens} of the prompt's {ids.shape[1]} tokens reused")
    return 0


def cmd_convert(args) -> int:
    """A model (a GGUF file or a Hugging Face directory) and its tokenizer written as a Hugging Face directory."""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"{args.out} exists and is not a directory", status=2)
    args.device = "cpu"
    model, tokenizer = _load(args, decoding=False)
    try:
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
    except (ValueError, OSError) as err:
        raise CliError(f"cannot write {args.out}: {err}") from None
    print(f"wrote {args.out}: config.json, model.safetensors ({args.dtype}) and the tokenizer", file=sys.stderr)
    return 0


def read_prompts(path: str, tokenizer) -> list[torch.Tensor]:
    """Token ids of a prompt set: rows with ``turns`` are chat (``turns[0]``), rows with ``prompt`` raw text. A
    line that is not such a JSON object is a ``ValueError`` naming the line (``line N:``)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"line {line_no}: not JSON ({err.msg} column {err.colno})") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if isinstance(turns, list) and turns and isinstance(turns[0], str):
                rows.append(_encode(tokenizer, turns[0], chat=True))
            elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
                rows.append(_encode(tokenizer, row["prompt"], chat=False))
            else:
                raise ValueError(f"line {line_no}: a row must be a JSON object with 'turns' (a list of strings: a "
                                 f"chat) or 'prompt' (a string: raw text)")
    return rows


def git_revision() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(device: str) -> dict:
    from .controller import cpu_model_name

    info = {"device": device, "cpu": cpu_model_name(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "git": git_revision()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _cuda_graphs(args) -> bool | None:
    """``generate``'s ``cuda_graphs``: False with ``--no-cuda-graphs`` on CUDA, else its default."""
    return False if args.no_cuda_graphs and torch.device(args.device).type == "cuda" else None


def run_prompt_set(model, prompts, config: LookaheadConfig, max_new_tokens: int, desc: str = "",
                   batch_size: int = 1, cuda_graphs: bool | None = None) -> dict:
    """Run the prompts plainly and with lookahead; returns per-prompt rows and the set's summary (``identical``:
    rows equal to plain decoding's). One prompt at a time, or with ``batch_size`` above 1 every prompt in one call
    of at most that many rows at once, a finished row's place going to the next prompt (``max_batch_size``; tokens/s
    over the call)."""
    from tqdm.auto import tqdm

    prompts = [ids.to(model.device) for ids in prompts]
    rows, seconds, plain_seconds = [], 0.0, 0.0
    one = batch_size == 1
    calls = [(ids, {}) for ids in prompts] if one else \
        [([ids[0] for ids in prompts], dict(max_batch_size=batch_size))]
    # The bar counts rows finished, each prompt's twice (plainly and with lookahead).
    with tqdm(total=2 * len(prompts), desc=desc, unit="row", file=sys.stderr) as bar:
        def run(ids, call, la):
            return model.generate(ids, max_new_tokens=max_new_tokens, lookahead=la, cuda_graphs=cuda_graphs,
                                  _on_finish=bar.update, **call)

        for ids, call in calls:
            plain, ours = run(ids, call, None), run(ids, call, config)
            seconds += ours.stats.seconds
            plain_seconds += plain.stats.seconds
            for b in range(ours.sequences.shape[0]):
                st = ours.stats.rows[b]
                rows.append({"prompt_tokens": (ids if one else ids[b]).shape[-1], "new_tokens": st.new_tokens,
                             "steps": st.steps, "compression": st.compression_ratio, "seconds": st.seconds,
                             "plain_seconds": plain.stats.rows[b].seconds,
                             "identical": bool(torch.equal(plain.sequences[b], ours.sequences[b]))})
    tok = sum(r["new_tokens"] for r in rows)
    summary = {
        "prompts": len(rows),
        "batch_size": batch_size,
        "mean_compression": statistics.fmean(r["compression"] for r in rows) if rows else 0.0,
        "tokens_per_second": tok / seconds if seconds else 0.0,
        "plain_tokens_per_second": tok / plain_seconds if plain_seconds else 0.0,
        "identical": sum(r["identical"] for r in rows),
    }
    return {"summary": summary, "rows": rows}


def cmd_bench(args) -> int:
    config = _config(args)
    _check_at_least_one("--batch-size", args.batch_size)
    _check_max_new_tokens(args)
    missing = [path for path in args.prompts if not os.path.isfile(path)]
    if missing:
        raise CliError(f"--prompts: no such file {missing[0]}", status=2)
    args.device = _device(args)
    model, tokenizer = _load(args)
    result = {"machine": machine_info(args.device), "command": " ".join(sys.argv), "dtype": args.dtype,
              "config": {"window": config.window, "ngram": config.ngram, "guess": config.guess,
                         "max_step_tokens": config.max_step_tokens, "device_tree": config.device_tree},
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "sets": {}}
    for path in args.prompts:
        prompts = read_prompts(path, tokenizer)[: args.limit]
        name = os.path.splitext(os.path.basename(path))[0]
        res = run_prompt_set(model, prompts, config, args.max_new_tokens, desc=name, batch_size=args.batch_size,
                             cuda_graphs=_cuda_graphs(args))
        result["sets"][name] = res
        s = res["summary"]
        ratio = s["tokens_per_second"] / s["plain_tokens_per_second"] if s["plain_tokens_per_second"] else 0.0
        print(f"{name}: {s['prompts']} prompts, compression {s['mean_compression']:.2f}, "
              f"{s['tokens_per_second']:.1f} tokens/s with lookahead vs {s['plain_tokens_per_second']:.1f} without "
              f"({ratio:.2f}x), {s['identical']}/{s['prompts']} identical")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lookahead", description="Lookahead decoding for Llama-family models.",
                     epilog="Failures print one line on stderr; set LOOKAHEAD_DEBUG=1 for a traceback.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text, streaming it, and print a summary line")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_decoding_args(g)
    g.set_defaults(func=cmd_generate)
    m = sub.add_parser("batch", help="generate for every prompt of a JSONL file, many rows at once; one JSON line "
                                     "per prompt")
    m.add_argument("prompts", help="JSONL file: rows with 'turns' (chat; the first turn) or 'prompt' (raw text)")
    m.add_argument("--max-batch-size", type=int, default=None,
                   help="rows decoded at once; a finished row's place goes to the next prompt (default: every "
                        "prompt at once)")
    m.add_argument("--limit", type=int, default=None, help="first N prompts of the file")
    m.add_argument("--out", default=None, help="write the JSON lines here instead of stdout")
    m.add_argument("--no-draft-memory", action="store_true",
                   help="guess only from each prompt's own text (default: finished prompts' text is guessed from "
                        "too, a DraftMemory; the output is the same either way)")
    _add_decoding_args(m)
    m.set_defaults(func=cmd_batch)
    c = sub.add_parser("chat", help="a conversation: turns read from stdin, answers streamed")
    c.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_decoding_args(c)
    c.set_defaults(func=cmd_chat)
    v = sub.add_parser("convert", help="write a model and its tokenizer (default: the embedded GGUF) as a Hugging "
                                       "Face directory that transformers loads")
    v.add_argument("out", help="the directory to write (made if missing)")
    v.add_argument("--model", default=None,
                   help="Hugging Face directory, .gguf file or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    v.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the weights written")
    v.set_defaults(func=cmd_convert)
    b = sub.add_parser("bench", help="run prompt sets with and without lookahead")
    b.add_argument("--prompts", nargs="+", required=True, help="JSONL files (rows with 'turns' or 'prompt')")
    b.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    b.add_argument("--out", default=None, help="write the results as JSON here")
    b.add_argument("--batch-size", type=int, default=1,
                   help="rows decoded at once, a finished row's place going to the next prompt (default 1); "
                        "tokens/s is over the set")
    _add_lookahead_args(b)
    b.set_defaults(func=cmd_bench)
    return parser


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def main(argv=None) -> int:
    """Run the command; every failure is one line on stderr and a non-zero status (no traceback)."""
    debug = os.environ.get("LOOKAHEAD_DEBUG", "") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CliError as err:
        if debug:
            raise
        print(f"lookahead: error: {_one_line(err)}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        print("lookahead: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the promise is one line, never a traceback
        if debug:
            raise
        print(f"lookahead: error: {type(err).__name__}: {_one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
