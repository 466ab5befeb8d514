"""``generate``'s arguments in transformers' conventions, normalised to what the decoding loops take.

* ``input_ids`` ``[B, L]`` (or ``[L]``) with an optional ``attention_mask`` of the same shape: per row all ones,
  or left padding (zeros, then ones), which is stripped before decoding and put back in front of the output, so
  ``model.generate(**tokenizer(texts, return_tensors="pt", padding=True))`` works (with the tokenizer's
  ``padding_side="left"``) and ``sequences`` has transformers' layout. Or a list of prompts of any lengths, each a
  list of ints or a 1-D tensor (no mask: each prompt is all tokens).
  A tokenizer's output (a ``BatchEncoding`` or any mapping holding ``input_ids`` and optionally
  ``attention_mask``) is also taken as ``input_ids``: transformers 5's ``apply_chat_template(...,
  return_tensors="pt")`` returns one.
* Sampling, processing, length and stopping parameters (``SUPPORTED_FIELDS``: ``do_sample``, ``temperature``,
  ``top_k``, ``top_p``, ``repetition_penalty``, ``max_new_tokens``, ``max_length``, ``eos_token_id``,
  ``num_return_sequences``...) as keywords, in a transformers ``GenerationConfig`` passed as ``generation_config``,
  or in the model's own ``model.generation_config`` (the checkpoint's ``generation_config.json``), in that order of
  precedence, as transformers layers them; ``None`` means unset. Unset everywhere, they take transformers' defaults
  (greedy; when sampling, temperature 1, top-k 50, top-p 1, no repetition penalty) and ours for the length (128
  new tokens); the EOS is the model's.
* ``repetition_penalty`` as transformers applies it (before temperature, top-k and top-p), to every row a step
  chooses or verifies a token from, each with its own context, and ``encoder_repetition_penalty`` with its prompt
  (:mod:`lookahead.repetition`); so are ``min_new_tokens`` and ``min_length`` (no EOS before that many new
  tokens, or that total length counting the padded prompt; ``min_new_tokens`` wins where both are set),
  ``forced_bos_token_id``, ``forced_eos_token_id``, ``remove_invalid_values``,
  ``exponential_decay_length_penalty``, ``suppress_tokens`` and ``begin_suppress_tokens``
  (:mod:`lookahead.length_rules`); and ``no_repeat_ngram_size``, ``encoder_no_repeat_ngram_size``,
  ``sequence_bias`` and ``bad_words_ids``, each row's and tree node's against its own sequence
  (:mod:`lookahead.sequence_rules`).
* ``stop_strings`` (with ``tokenizer=``), ``stopping_criteria`` and ``max_time`` end a row as transformers ends it
  (:mod:`lookahead.stopping`).
* The output is the ``sequences`` tensor with ``stats`` (and ``scores``, ``logits``) as attributes
  (:class:`lookahead.outputs.GenerateOutput`); with ``return_dict_in_generate=True`` its integer index reads it as
  transformers' output object (``out[0]``: ``sequences``).
* ``output_scores`` and ``output_logits`` return, for each new token, the row it was chosen from (processed and
  warped as transformers reports it, log-softmaxed with ``renormalize_logits``, or raw), whether the token came from
  a plain step or a verified tree node.
* Fields that choose how transformers computes, not what (``OUTPUT_NEUTRAL_FIELDS``: ``cache_implementation="static"``,
  ``prompt_lookup_num_tokens``...) are accepted; our own cache, steps and drafts serve them.
* ``num_return_sequences=n`` (sampling only) draws ``n`` sequences per prompt, as rows ``b * n .. b * n + n - 1``.
* A streamer is a plain callable (called with each step's new token ids, a ``list[int]``) or an object with
  ``put``/``end`` (transformers' ``TextStreamer``, ``TextIteratorStreamer``): ``put`` receives the prompt first
  (``[1, L]``, as given), then each step's new tokens (plain decoding: a ``[1]`` tensor per token, as
  transformers' sampling loop; lookahead: ``[1, n]`` per step, as its assisted decoding), and ``end()`` is called
  once generation finishes.
* Anything else, a ``GenerationConfig`` field or keyword set to a value we would have to ignore (``num_beams=4``,
  ``guidance_scale=1.5``, ``output_attentions=True``...) or an unknown keyword, is a ``ValueError`` naming it.
  Values equal to transformers' defaults (``num_beams=1``, ``typical_p=1.0``...) are accepted.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

import torch

from .sequence_rules import bad_word_list, check_no_repeat_ngram_size, sequence_biases

DEFAULT_MAX_NEW_TOKENS = 128
# GenerationConfig fields generate() implements.
SUPPORTED_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                    "max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "num_return_sequences",
                    "repetition_penalty", "min_new_tokens", "min_length", "suppress_tokens", "begin_suppress_tokens",
                    "stop_strings", "max_time", "output_scores", "output_logits", "no_repeat_ngram_size",
                    "sequence_bias", "bad_words_ids", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
                    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
                    "exponential_decay_length_penalty", "renormalize_logits", "top_h", "return_dict_in_generate")
# Fields that choose how transformers computes, never what it outputs: accepted, our own cache, steps and drafts
# serve them (prompt lookup's n-gram drafts are among lookahead's own guesses). ``cache_implementation`` only at
# the values that keep the output exact (a quantized cache changes it); ``None``: any value.
OUTPUT_NEUTRAL_FIELDS = {"cache_implementation": ("dynamic", "static", "offloaded", "offloaded_static"),
                         "compile_config": None, "disable_compile": None, "prefill_chunk_size": None,
                         "max_cache_len": None, "low_memory": None, "prompt_lookup_num_tokens": None,
                         "max_matching_ngram_size": None}
# Fields accepted with any value: they cannot change a decoder-only model's output given a prompt (use_cache=False
# only makes transformers recompute every position; we always keep a cache).
INERT_FIELDS = ("bos_token_id", "transformers_version", "use_cache")
# transformers' values for supported fields that nobody set (GenerationConfig._get_default_generation_params).
SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "num_return_sequences": 1,
                     "repetition_penalty": 1.0}


@dataclasses.dataclass
class GenerateArguments:
    """The normalised arguments.

    Attributes:
        prompts: per row, LongTensor ``[L_b]`` (CPU), the prompt without its left padding (not range-checked).
        padding: per row, LongTensor ``[P_b]``, the stripped left padding as given (``P_b`` may be 0; empty for a
            list of prompts); goes back in front of the output.
        max_new_tokens: resolved int (not yet range-checked against the model).
        do_sample, temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff: the sampling
            parameters, unset ones at their defaults (``min_p`` and the last three: ``None``, off).
        repetition_penalty: float > 0 (1.0: none).
        min_new_tokens: int >= 0: no EOS before that many new tokens (``min_length`` resolved into it).
        suppress_tokens, begin_suppress_tokens: lists of ids >= 0 (not yet range-checked), maybe empty.
        no_repeat_ngram_size: int >= 0 (0: none).
        sequence_bias: ``{tuple of ids: bias}`` in transformers' order, maybe empty (ids not yet range-checked).
        bad_words_ids: list of tuples of ids, maybe empty (not yet range-checked; the EOS not yet dropped).
        prompt_penalty: ``encoder_repetition_penalty``, float > 0 (1.0: none).
        prompt_ngram_size: ``encoder_no_repeat_ngram_size``, int >= 0 (0: none).
        forced_bos_token_id: int or ``None``; forced_eos_token_id: list of ids, maybe empty (not yet
            range-checked).
        remove_invalid_values, renormalize_logits: bools.
        return_dict_in_generate: bool: whether the output's integer index reads it as transformers' output object
            (``out[0]``: ``sequences``) rather than as the tokens (:class:`lookahead.outputs.GenerateOutput`).
        decay: ``exponential_decay_length_penalty`` as ``(int start, float factor)``, or ``None``.
        top_h: in ``(0, 1]``, or ``None`` (off).
        padded_length: the prompt's length as transformers counts it (a batch's longest, padding included).
        stop_strings: a string, a list of them, or ``None`` (checked by :func:`lookahead.stopping.make_criteria`).
        max_time: seconds, or ``None`` (checked by :class:`lookahead.stopping.Deadline`).
        outputs: which rows of each new token's choice to return: ``"scores"`` (``output_scores``), ``"logits"``
            (``output_logits``), in that order.
        eos_token_id: int, list of ints, or ``None`` (the model's own).
        pad_token_id: int or ``None``.
        streamer: a :class:`StreamerAdapter` or ``None``.
    """

    prompts: list
    padding: list
    max_new_tokens: object
    do_sample: object
    temperature: object
    top_k: object
    top_p: object
    min_p: object
    typical_p: object
    epsilon_cutoff: object
    eta_cutoff: object
    repetition_penalty: float
    min_new_tokens: int
    suppress_tokens: list
    begin_suppress_tokens: list
    no_repeat_ngram_size: int
    sequence_bias: dict
    bad_words_ids: list
    prompt_penalty: float
    prompt_ngram_size: int
    forced_bos_token_id: object
    forced_eos_token_id: list
    remove_invalid_values: bool
    decay: object
    renormalize_logits: bool
    return_dict_in_generate: bool
    top_h: object
    padded_length: int
    stop_strings: object
    max_time: object
    outputs: tuple
    eos_token_id: object
    pad_token_id: object
    streamer: "StreamerAdapter | None"


class StreamerAdapter:
    """Calls a plain callable with ``list[int]``, or drives a transformers-style streamer's ``put``/``end``."""

    def __init__(self, streamer, one_token_per_step: bool):
        self.target = streamer
        self.put_end = callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
        if not self.put_end and not callable(streamer):
            raise ValueError(f"streamer must be a callable taking a list of token ids, or an object with put() and "
                             f"end() methods (transformers' TextStreamer), got {type(streamer).__name__}")
        self.one_token_per_step = one_token_per_step

    def start(self, prompt: torch.Tensor) -> None:
        """The prompt ``[1, L]`` (as passed, padding included), as transformers puts it first."""
        if self.put_end:
            self.target.put(prompt.detach().cpu())

    def __call__(self, tokens: list[int]) -> None:
        if not self.put_end:
            self.target(tokens)
        elif self.one_token_per_step and len(tokens) == 1:
            self.target.put(torch.tensor(tokens, dtype=torch.long))
        else:
            self.target.put(torch.tensor([tokens], dtype=torch.long))

    def end(self) -> None:
        if self.put_end:
            self.target.end()


def _generation_config_fields(generation_config) -> dict:
    """The fields a transformers ``GenerationConfig`` sets (not ``None``), private ones left out."""
    try:
        from transformers import GenerationConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        GenerationConfig = None
    if GenerationConfig is None or not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig or None, got "
                         f"{type(generation_config).__name__}")
    return {k: v for k, v in generation_config.to_dict().items() if v is not None and not k.startswith("_")}


def model_generation_config(config, source=None, origin: str = "generation_config.json"):
    """A model's generation defaults (``model.generation_config``): a transformers ``GenerationConfig``.

    ``config``: the model's :class:`~lookahead.model.ModelConfig`. ``source``: a ``GenerationConfig`` read from a
    checkpoint (``origin`` names it) or a transformers model's; its fields that generate cannot honour
    (``num_beams=4``...) are left out of the copy returned, with a warning naming them, so each later
    call does not fail on them. Without ``source``: the config's BOS, EOS and pad ids, as transformers derives a
    generation config from a model config."""
    import copy
    import warnings

    from transformers import GenerationConfig

    if source is None:
        return GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                                eos_token_id=config.hf_eos_token_id)
    if not isinstance(source, GenerationConfig):
        raise ValueError(f"a generation config must be a transformers GenerationConfig, got {type(source).__name__}")
    ours = copy.deepcopy(source)
    bad = unsupported_fields(_generation_config_fields(ours))
    if bad:
        warnings.warn(f"{origin} sets {', '.join(bad)}, which lookahead's generate does not support; left out of "
                      f"model.generation_config (so generate's output differs from what transformers' generate "
                      f"would give with these defaults)", UserWarning, stacklevel=3)
        for item in bad:
            setattr(ours, item.split("=", 1)[0], None)
    return ours


def _transformers_defaults() -> dict:
    # Output switches a model's generation config may hold switched off (transformers' list leaves them out).
    off = {"output_attentions": False, "output_hidden_states": False, "output_logits": False}
    try:
        from transformers import GenerationConfig

        return {**off, **GenerationConfig._get_default_generation_params()}
    except (ImportError, AttributeError):  # pragma: no cover - older transformers
        return off


def _generation_field_names() -> set[str]:
    try:
        from transformers import GenerationConfig

        return set(GenerationConfig().to_dict())
    except ImportError:  # pragma: no cover
        return set()


def unsupported_fields(fields: dict) -> list[str]:
    """``name=value`` of every field we would have to ignore (set, and not transformers' default value)."""
    defaults = _transformers_defaults()
    bad = []
    for name, value in fields.items():
        if name in SUPPORTED_FIELDS or name in INERT_FIELDS or value is None:
            continue
        if name in defaults and _same(value, defaults[name]):
            continue
        if name in OUTPUT_NEUTRAL_FIELDS:
            allowed = OUTPUT_NEUTRAL_FIELDS[name]
            if allowed is None or value in allowed:
                continue
            bad.append(f"{name}={value!r} (only {', '.join(map(repr, allowed))} keep the output exact)")
            continue
        bad.append(f"{name}={value!r}")
    return bad


def _check_unsupported(fields: dict, origin: str) -> None:
    """ValueError naming every field we would have to ignore."""
    bad = unsupported_fields(fields)
    if bad:
        raise ValueError(f"generate does not support {', '.join(bad)} ({origin}); supported: "
                         f"{', '.join(SUPPORTED_FIELDS)} (others only at transformers' default values)")


def _same(a, b) -> bool:
    if type(a) is bool or type(b) is bool:
        return a is b
    return a == b


def mask_rows(attention_mask, shape: tuple[int, int]) -> list[tuple[int, int, int]]:
    """Per row of an ``attention_mask`` like ``input_ids`` of ``shape`` ``[B, L]`` (``[L]`` for one row): the
    ``(first, last + 1, count)`` of its ones. The mask must be a tensor of that shape holding only 0 and 1, with at
    least one 1 a row; where the ones may lie is the caller's to say."""
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a tensor like input_ids, got {type(attention_mask).__name__}")
    mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(shape)}; they must match")
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    rows = []
    for b, row in enumerate(mask.to(device="cpu", dtype=torch.long)):
        ones = row.nonzero().flatten()
        if ones.numel() == 0:
            where = f" (row {b})" if mask.shape[0] > 1 else ""
            raise ValueError(f"attention_mask is all zeros{where}: that row has no tokens")
        rows.append((int(ones[0]), int(ones[-1]) + 1, ones.numel()))
    return rows


def _strip_left_padding(ids: torch.Tensor, attention_mask) -> tuple[list, list]:
    """Per row: (prompt, padding), 1-D each, from ``ids [B, L]`` and an optional left-padding mask."""
    if attention_mask is None:
        return list(ids), [row[:0] for row in ids]
    prompts, padding = [], []
    L = ids.shape[1]
    for b, (start, end, count) in enumerate(mask_rows(attention_mask, tuple(ids.shape))):
        if end != L or count != L - start:
            where = f" (row {b})" if ids.shape[0] > 1 else ""
            raise ValueError(f"attention_mask must be all ones, or left padding (zeros, then ones){where}; right "
                             f"padding or gaps inside the prompt are not supported")
        prompts.append(ids[b, start:])
        padding.append(ids[b, :start])
    return prompts, padding


def check_ids_dtype(t: torch.Tensor, name: str) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {t.dtype}")


def check_repetition_penalty(penalty, name: str = "repetition_penalty") -> float:
    """``penalty`` as a float; ``ValueError`` (naming the argument ``name``) unless it is a finite number > 0."""
    if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real) or not 0 < penalty < float("inf"):
        raise ValueError(f"{name} must be a number > 0 (1.0: none), got {penalty!r}")
    return float(penalty)


def _optional_int(value):
    return None if value is None else int(value.item() if isinstance(value, torch.Tensor) else value)


def _id_list(value) -> list[int]:
    """An id or a list of them (already checked) as a list."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _decay(value):
    """``exponential_decay_length_penalty`` as ``(start, factor)``, or ``None``."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or isinstance(value[0], bool)
            or not isinstance(value[0], numbers.Integral) or isinstance(value[1], bool)
            or not isinstance(value[1], numbers.Real) or not math.isfinite(value[1])):
        raise ValueError(f"exponential_decay_length_penalty must be (start_index, decay_factor): an int and a "
                         f"finite number, got {value!r}")
    return int(value[0]), float(value[1])


def _top_h(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"top_h must be a number in (0, 1] (None: off), got {value!r}")
    return float(value)


def _min_new_tokens(min_new_tokens, min_length, given_len: int) -> int:
    """No EOS before this many new tokens: ``min_new_tokens`` where set (transformers lets it win), else what
    ``min_length`` (counting the prompt as given, padding included) leaves after the prompt."""
    for name, value in (("min_new_tokens", min_new_tokens), ("min_length", min_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if min_new_tokens is not None:
        return int(min_new_tokens)
    return max(int(min_length) - given_len, 0) if min_length is not None else 0


def _token_list(name: str, value) -> list[int]:
    """``value`` (``None``, or a list of ids) as a list of ints >= 0."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                                                   or v < 0 for v in value):
        raise ValueError(f"{name} must be a list of token ids (ints >= 0), got {value!r}")
    return [int(v) for v in value]


def _unpack_encoding(input_ids, attention_mask):
    """``(input_ids, attention_mask)`` out of a tokenizer's output passed as ``input_ids``; else as given."""
    if not isinstance(input_ids, Mapping):
        return input_ids, attention_mask
    other = sorted(str(k) for k in input_ids if k not in ("input_ids", "attention_mask"))
    if "input_ids" not in input_ids or other:
        raise ValueError(f"a mapping passed as input_ids (a tokenizer's output) must hold input_ids and optionally "
                         f"attention_mask; got keys {sorted(str(k) for k in input_ids)}")
    if attention_mask is not None and "attention_mask" in input_ids:
        raise ValueError("attention_mask given twice: in the tokenizer output passed as input_ids and as a keyword")
    mask = input_ids.get("attention_mask", attention_mask)
    return input_ids["input_ids"], mask


def _as_2d_ids(input_ids) -> torch.Tensor:
    if input_ids is None:
        raise ValueError("generate needs input_ids (a LongTensor [B, prompt_len], or a list of prompts)")
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a LongTensor [B, prompt_len] or a list of prompts, got "
                         f"{type(input_ids).__name__}")
    check_ids_dtype(input_ids, "input_ids")
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, prompt_len] or [prompt_len], got shape {tuple(input_ids.shape)}")
    if ids.shape[0] == 0:
        raise ValueError("input_ids has a batch of 0 prompts; at least one is needed")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: input_ids needs at least one token")
    return ids


def _prompt_list(prompts) -> list:
    """A list of prompts (lists of ints or 1-D integer tensors) as 1-D LongTensors."""
    if len(prompts) == 0:
        raise ValueError("the list of prompts is empty; at least one prompt is needed")
    out = []
    for b, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            check_ids_dtype(p, f"prompt {b}")
            if p.dim() != 1:
                raise ValueError(f"prompt {b} must be a 1-D tensor or a list of ints, got shape {tuple(p.shape)}")
            t = p.long()
        elif isinstance(p, (list, tuple)):
            if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in p):
                raise ValueError(f"prompt {b} must hold ints (token ids), got {list(p)[:8]!r}")
            t = torch.tensor([int(v) for v in p], dtype=torch.long)
        else:
            raise ValueError(f"a list of prompts must hold lists of ints or 1-D tensors, got {type(p).__name__} "
                             f"at {b} (for one prompt pass a tensor or a list holding one list)")
        if t.numel() == 0:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        out.append(t)
    return out


def _check_token_id(name: str, value, allow_list: bool) -> None:
    if value is None:
        return
    values = list(value) if allow_list and isinstance(value, (list, tuple, torch.Tensor)) else [value]
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            kind = "an int or a list of ints" if allow_list else "an int"
            raise ValueError(f"{name} must be {kind} >= 0, got {value!r}")


def resolve_generate_arguments(input_ids, *, attention_mask=None, max_new_tokens=None, do_sample=None,
                               temperature=None, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None,
                               generation_config=None, model_generation_config=None, streamer=None,
                               one_token_per_step: bool = False, extra: dict | None = None) -> GenerateArguments:
    """Validate and normalise ``generate``'s arguments (see the module docstring); ``extra``: other keywords;
    ``model_generation_config``: the model's defaults (``model.generation_config``), beneath ``generation_config``.

    Raises ``ValueError`` naming the argument for anything unsupported."""
    extra = dict(extra or {})
    input_ids, attention_mask = _unpack_encoding(input_ids, attention_mask)
    known = _generation_field_names()
    unknown = sorted(k for k in extra if k not in known)
    if unknown:
        raise ValueError(f"generate got unexpected argument(s) {', '.join(unknown)}; it takes input_ids, "
                         f"attention_mask, max_new_tokens, lookahead, do_sample, temperature, top_k, top_p, "
                         f"generator, eos_token_id, pad_token_id, generation_config, streamer, stopping_criteria, "
                         f"tokenizer, logits_processor, prefix_allowed_tokens_fn, trace, prompt_cache and "
                         f"transformers' GenerationConfig fields")
    _check_unsupported(extra, "keyword argument")
    explicit = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature,
                "top_k": top_k, "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
                "max_length": extra.get("max_length"), "num_return_sequences": extra.get("num_return_sequences"),
                **{k: extra.get(k) for k in ("repetition_penalty", "min_new_tokens", "min_length", "suppress_tokens",
                                             "begin_suppress_tokens", "stop_strings", "max_time", "output_scores",
                                             "output_logits", "min_p", "typical_p", "epsilon_cutoff",
                                             "eta_cutoff", "no_repeat_ngram_size", "sequence_bias",
                                             "bad_words_ids", "encoder_repetition_penalty",
                                             "encoder_no_repeat_ngram_size", "forced_bos_token_id",
                                             "forced_eos_token_id", "remove_invalid_values",
                                             "exponential_decay_length_penalty", "renormalize_logits",
                                             "top_h", "return_dict_in_generate")}}
    values = {}
    for config, origin in ((model_generation_config, "in model.generation_config"),
                           (generation_config, "in generation_config")):  # later ones override
        if config is not None:
            fields = _generation_config_fields(config)
            _check_unsupported(fields, origin)
            values.update({k: v for k, v in fields.items() if k in SUPPORTED_FIELDS})
    values.update({k: v for k, v in explicit.items() if v is not None})  # keywords override the configs
    values = {**SAMPLING_DEFAULTS, **values}

    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with input_ids [B, L]; a list of prompts needs none (each "
                             "prompt is all tokens)")
        prompts = _prompt_list(input_ids)
        padding = [p[:0] for p in prompts]
        given_len = max(p.numel() for p in prompts)
    else:
        ids = _as_2d_ids(input_ids)
        prompts, padding = _strip_left_padding(ids, attention_mask)
        given_len = ids.shape[1]

    max_new = values.get("max_new_tokens")
    if max_new is None and values.get("max_length") is not None:
        max_length = values["max_length"]
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
            raise ValueError(f"max_length must be an int, got {max_length!r}")
        max_new = int(max_length) - given_len  # transformers counts the padded prompt
        if max_new < 1:
            raise ValueError(f"max_length={max_length} leaves no room after the {given_len}-token prompt; "
                             f"use max_new_tokens")
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS

    copies = values["num_return_sequences"]
    if isinstance(copies, bool) or not isinstance(copies, numbers.Integral) or copies < 1:
        raise ValueError(f"num_return_sequences must be an int >= 1, got {copies!r}")
    if copies > 1:
        if values["do_sample"] is not True:
            raise ValueError(f"num_return_sequences={copies} needs do_sample=True: greedy decoding gives one "
                             f"sequence per prompt (transformers would need beam search, which we do not support)")
        prompts = [p for p in prompts for _ in range(copies)]  # transformers' order: each prompt's draws together
        padding = [p for p in padding for _ in range(copies)]

    penalty = check_repetition_penalty(values["repetition_penalty"])
    min_new = _min_new_tokens(values.get("min_new_tokens"), values.get("min_length"), given_len)
    suppressed = {name: _token_list(name, values.get(name)) for name in ("suppress_tokens", "begin_suppress_tokens")}
    flags = {}
    for name in ("remove_invalid_values", "renormalize_logits", "return_dict_in_generate"):
        flag = values.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
        flags[name] = bool(flag)
    outputs = []
    for name, kept in (("output_scores", "scores"), ("output_logits", "logits")):
        flag = values.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
        if flag:
            outputs.append(kept)

    _check_token_id("eos_token_id", values.get("eos_token_id"), allow_list=True)
    _check_token_id("pad_token_id", values.get("pad_token_id"), allow_list=False)
    _check_token_id("forced_bos_token_id", values.get("forced_bos_token_id"), allow_list=False)
    _check_token_id("forced_eos_token_id", values.get("forced_eos_token_id"), allow_list=True)
    _check_forced_not_suppressed(values, suppressed["suppress_tokens"])
    eos = values.get("eos_token_id")
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    if isinstance(eos, tuple):
        eos = list(eos)
    adapter = None if streamer is None else StreamerAdapter(streamer, one_token_per_step)
    return GenerateArguments(
        prompts=prompts, padding=padding, max_new_tokens=max_new,
        do_sample=values["do_sample"], temperature=values["temperature"], top_k=values["top_k"],
        top_p=values["top_p"], min_p=values.get("min_p"), typical_p=values.get("typical_p"),
        epsilon_cutoff=values.get("epsilon_cutoff"), eta_cutoff=values.get("eta_cutoff"),
        repetition_penalty=penalty, min_new_tokens=min_new,
        **suppressed, no_repeat_ngram_size=check_no_repeat_ngram_size(values.get("no_repeat_ngram_size")),
        sequence_bias=sequence_biases(values.get("sequence_bias")),
        bad_words_ids=bad_word_list(values.get("bad_words_ids")),
        prompt_penalty=check_repetition_penalty(values.get("encoder_repetition_penalty", 1.0),
                                                "encoder_repetition_penalty"),
        prompt_ngram_size=check_no_repeat_ngram_size(values.get("encoder_no_repeat_ngram_size"),
                                                     "encoder_no_repeat_ngram_size"),
        forced_bos_token_id=_optional_int(values.get("forced_bos_token_id")),
        forced_eos_token_id=_id_list(values.get("forced_eos_token_id")), **flags,
        decay=_decay(values.get("exponential_decay_length_penalty")), top_h=_top_h(values.get("top_h")),
        padded_length=given_len,
        stop_strings=values.get("stop_strings"), max_time=values.get("max_time"), outputs=tuple(outputs),
        eos_token_id=eos, pad_token_id=values.get("pad_token_id"), streamer=adapter)


def _check_forced_not_suppressed(values: dict, suppressed: list) -> None:
    """transformers' refusal: a forced token that ``suppress_tokens`` also removes leaves no token at that step (every
    logit -inf), where sampling could draw nothing and greedy decoding would emit token 0."""
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = _id_list(values.get(name))
        if suppressed and forced and set(forced) <= set(suppressed):
            raise ValueError(f"every token of {name} ({sorted(set(forced))}) is also in suppress_tokens: the step that "
                             f"forces it would have no token left; remove it from one of them (to keep EOS from coming "
                             f"early, use min_new_tokens)")


__all__ = ["GenerateArguments", "StreamerAdapter", "resolve_generate_arguments", "model_generation_config",
           "unsupported_fields", "check_repetition_penalty", "SUPPORTED_FIELDS", "SAMPLING_DEFAULTS",
           "DEFAULT_MAX_NEW_TOKENS"]
