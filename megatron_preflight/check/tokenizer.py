"""The tokenizer's files, by ``--tokenizer-type``: named in the same report as everything else, instead of one
traceback from the tokenizer's constructor (megatron-core's ``build_tokenizer``).

GPT-2 BPE needs ``--vocab-file`` and ``--merge-file``; BERT word-piece ``--vocab-file``; SentencePiece (incl. the
GPT and Llama-2 forms), tiktoken, the multimodal and SFT tokenizers ``--tokenizer-model`` (a file); HuggingFace's
``--tokenizer-model`` is a local directory/file or a hub name (``org/name``), which needs the network unless the
hub cache holds it; the null tokenizer needs ``--vocab-size``.
"""

from __future__ import annotations

import os

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.hf.files import tokenizer_code
from megatron_preflight.layout.hf.names import TOKENIZER_FILES

FATAL, INFO = Severity.FATAL, Severity.INFO

_FILES: dict[str, tuple[str, ...]] = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "MultimodalTokenizer": ("tokenizer_model",),
    "SFTTokenizer": ("tokenizer_model",),
}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _hub_name(value: str) -> bool:
    """``org/name`` (one slash, no leading ./ or /): what HuggingFace resolves on its hub."""
    return value.count("/") == 1 and not value.startswith((".", "/", "~"))


def tokenizer_findings(rt: RuntimeArgs) -> list[Finding]:
    """Every file the run's tokenizer opens exists."""
    kind = rt.tokenizer_type
    if not kind:
        return []
    if kind in ("NullTokenizer", "NullMultimodalTokenizer"):
        if rt.vocab_size is None and "vocab_size" not in rt.given:
            return [Finding("tokenizer", None, kind, FATAL, f"--tokenizer-type {kind} needs --vocab-size",
                            "add --vocab-size N")]
        return []
    out = []
    if kind == "HuggingFaceTokenizer":
        model = rt.tokenizer_model
        if not model:
            return [Finding("tokenizer", None, kind, FATAL, "--tokenizer-type HuggingFaceTokenizer needs "
                            "--tokenizer-model (a local directory or a hub name)", "add --tokenizer-model")]
        code = tokenizer_code(model) if os.path.isdir(model) else None
        if code and not rt.trust_remote_code:
            out.append(Finding("tokenizer", "trust_remote_code", model, FATAL,
                               f"the tokenizer in {model} is its own code (tokenizer_config.json's auto_map names "
                               f"{code}): Megatron's HuggingFaceTokenizer (transformers' AutoTokenizer) refuses to "
                               "load it unless the run trusts that code, after the job has started",
                               "add --trust-remote-code (it runs that file from the model dir: read it first)"))
        if os.path.isdir(model) and not any(os.path.isfile(os.path.join(model, n)) for n in TOKENIZER_FILES):
            out.append(Finding("tokenizer", None, model, FATAL,
                               f"--tokenizer-model {model} holds no tokenizer files (none of "
                               f"{', '.join(TOKENIZER_FILES)}): Megatron's HuggingFaceTokenizer fails to load it "
                               "('Unable to instantiate HuggingFace AutoTokenizer')",
                               "point --tokenizer-model at the directory that holds the model's tokenizer, or use "
                               "--tokenizer-type NullTokenizer with --vocab-size (for a Hugging Face model, "
                               "`megatron-preflight flags MODEL_DIR` prints the value)"))
        elif not os.path.exists(model):
            if not _hub_name(model):
                out.append(Finding("tokenizer", None, model, FATAL, f"--tokenizer-model {model} does not exist",
                                   "fix the path (a directory holding tokenizer.json / tokenizer_config.json)"))
            elif os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "TRUE"):
                out.append(Finding("tokenizer", None, model, INFO,
                                   f"--tokenizer-model {model} is a hub name and HF_HUB_OFFLINE is set: it loads "
                                   "only if the hub cache already holds it", "pass a local directory"))
        return out
    for field in _FILES.get(kind, ()):
        path = getattr(rt, field)
        if not path:
            out.append(Finding("tokenizer", None, kind, FATAL, f"--tokenizer-type {kind} needs {_flag(field)}",
                               f"add {_flag(field)} PATH"))
        elif not os.path.isfile(path):
            out.append(Finding("tokenizer", None, path, FATAL,
                               f"{_flag(field)} {path} " + ("is not a file" if os.path.exists(path) else
                                                            "does not exist") + f" (--tokenizer-type {kind})",
                               f"fix the path of {_flag(field)}"))
    return out
