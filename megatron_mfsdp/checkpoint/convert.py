"""tools/checkpoint/convert.py's loaders and savers, with Megatron-LM's vocabulary (``--loader``,
``--saver``; tools/checkpoint/convert.py at core_v0.16.1). Megatron-LM streams unsplit tensors
through a queue from a loader process to a saver process; here a loader returns one
``Loaded`` (stored args, whole tensors by state-dict name, a tokenizer folder if any) and a saver
writes it:

- ``mfsdp``: our ``--ckpt-format torch_dist`` checkpoints (model_files.py), read from any layout;
  written at 1 x 1 x 1, which dist_checkpointing reshards when a run loads it at another layout;
- ``hf``: a Hugging Face LlamaForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM
  folder (safetensors, config.json and the tokenizer files when the source has them), mapped by models/gpt/hf.py.

Megatron-LM's own loader and saver names (``LOADERS``, ``SAVERS``; tools/checkpoint/ at HEAD has
loader_core/saver_core, with ``mcore`` its old spelling, and core_v0.16.1 also loader_llama_mistral,
loader_legacy/saver_legacy and ``megatron``, the old spelling of legacy) are taken where they mean a
format read or written here; ``resolve`` names the format and refuses the others with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from ..models.gpt import hf
from .model_files import read_model_checkpoint, write_model_checkpoint

# The files of a saved Hugging Face tokenizer (what save_pretrained writes for the common kinds).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
TOKENIZER_SUBDIR = "tokenizer"
DTYPE_FLAGS = {torch.bfloat16: {"bf16": True, "fp16": False}, torch.float16: {"bf16": False, "fp16": True}}


_TORCH_DIST = "--ckpt-format torch_dist (Megatron-LM's layout: megatron-mfsdp's or Megatron-LM's own, any TP x PP x DP)"
_HF = "a Hugging Face LlamaForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM folder"
_LEGACY = (
    "Megatron-LM's legacy checkpoints (per-rank mp_rank_* files of its non-megatron-core models) are not {}; "
    "convert them with Megatron-LM's own tools/checkpoint/convert.py to core (torch_dist) first"
)
# name -> (our loader, the format it means), or (None, why it is refused)
LOADERS = {
    "mfsdp": ("mfsdp", _TORCH_DIST),
    "core": ("mfsdp", _TORCH_DIST + "; Megatron-LM's loader_core"),
    "mcore": ("mfsdp", _TORCH_DIST + "; Megatron-LM's old name of core"),
    "hf": ("hf", _HF),
    "llama_mistral": (
        "hf",
        _HF + " (Megatron-LM core_v0.16.1's loader_llama_mistral with --checkpoint-type hf; a Mistral "
        "folder is refused by the hf loader, naming its model_type)",
    ),
    "legacy": (None, _LEGACY.format("read")),
    "megatron": (None, _LEGACY.format("read") + " (megatron is core_v0.16.1's old name of legacy)"),
}
SAVERS = {
    "mfsdp": ("mfsdp", _TORCH_DIST),
    "core": ("mfsdp", _TORCH_DIST + "; Megatron-LM's saver_core"),
    "mcore": ("mfsdp", _TORCH_DIST + "; Megatron-LM's old name of core"),
    "hf": ("hf", _HF),
    "legacy": (None, _LEGACY.format("written")),
    "megatron": (None, _LEGACY.format("written") + " (megatron is core_v0.16.1's old name of legacy)"),
}


def resolve(kind: str, name: str) -> tuple[str, str]:
    """(our loader or saver, the format it means) of a --loader/--saver ``name`` (``kind``: loader or
    saver); a name we cannot honour raises ConversionError with the reason."""
    table = LOADERS if kind == "loader" else SAVERS
    if name not in table:
        raise hf.ConversionError(f"--{kind} {name!r}: choose one of {', '.join(table)}")
    ours, meaning = table[name]
    if ours is None:
        raise hf.ConversionError(f"--{kind} {name}: {meaning}")
    return ours, meaning


@dataclasses.dataclass
class Loaded:
    """What a loader hands a saver: Megatron-LM args (dests -> values), whole tensors, and the
    folder holding the source's Hugging Face tokenizer files (None when it has none)."""

    args: dict
    tensors: dict
    tokenizer_dir: str | None = None
    iteration: int = 0


def tokenizer_from_args(stored: dict):
    """The training tokenizer a checkpoint's stored --tokenizer-* flags describe (data/tokenizers.py)."""
    from ..data.datasets import build_tokenizer

    if not stored.get("tokenizer_type"):
        raise hf.ConversionError("the checkpoint's args have no tokenizer_type (--tokenizer-type)")
    return build_tokenizer(
        stored["tokenizer_type"],
        stored.get("tokenizer_model"),
        stored.get("vocab_size"),
        vocab_file=stored.get("vocab_file"),
        merge_file=stored.get("merge_file"),
        vocab_extra_ids=stored.get("vocab_extra_ids") or 0,
        tokenizer_special_tokens=stored.get("tokenizer_special_tokens"),
        tiktoken_pattern=stored.get("tiktoken_pattern"),
        tiktoken_num_special_tokens=stored.get("tiktoken_num_special_tokens") or 1000,
        trust_remote_code=bool(stored.get("trust_remote_code")),
    )


def copy_tokenizer_files(source: str, target: str) -> list[str]:
    """Copy the Hugging Face tokenizer files found in ``source`` to ``target``; returns their names."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))]
    if names:
        os.makedirs(target, exist_ok=True)
        for name in names:
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
    return names


# ----------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------


def load_hf(load_dir: str, base_args: dict | None = None, make_vocab_size_divisible_by: int = 128) -> Loaded:
    """A Hugging Face folder as Megatron-LM args (``base_args``, e.g. pretrain_gpt.py's defaults,
    overlaid with the model's settings and its dtype flag) and whole tensors."""
    state_dict, config = hf.load_hf_checkpoint(load_dir)
    tensors, model_args = hf.hf_to_megatron(state_dict, config, make_vocab_size_divisible_by)
    dtype = tensors["embedding.word_embeddings.weight"].dtype
    args = {**(base_args or {}), **model_args, **DTYPE_FLAGS.get(dtype, {"bf16": False, "fp16": False})}
    has_tokenizer = any(os.path.isfile(os.path.join(load_dir, n)) for n in TOKENIZER_FILES)
    return Loaded(args, tensors, load_dir if has_tokenizer else None)


def true_vocab_size(stored: dict, given: int | None = None) -> int:
    """The embedding rows that are tokens (Megatron-LM pads the rest): --true-vocab-size, else the
    stored --vocab-size (a converted Hugging Face model's, TikTokenizer's), else the size of the
    tokenizer the stored flags build. NullTokenizer's --vocab-size excludes its eod, so it is
    asked for its size (vocab_size + 1, as Megatron-LM's _NullTokenizer)."""
    if given is not None:
        return given
    if stored.get("vocab_size") and stored.get("tokenizer_type") != "NullTokenizer":
        return int(stored["vocab_size"])
    try:
        return tokenizer_from_args(stored).vocab_size
    except Exception as err:  # the tokenizer files may be gone; say what to pass instead
        raise hf.ConversionError(
            f"cannot tell the unpadded vocabulary size: the stored tokenizer flags do not build one ({err}); "
            "pass --true-vocab-size"
        ) from err


def load_mfsdp(load_dir: str, step: int | None = None, vocab_size: int | None = None) -> Loaded:
    """One of our torch_dist checkpoints, saved at any layout, as its stored args and whole tensors."""
    args, tensors = read_model_checkpoint(load_dir, step)
    args["vocab_size"] = true_vocab_size(args, vocab_size)
    folder = args.get("tokenizer_model")
    is_hf_folder = args.get("tokenizer_type") == "HuggingFaceTokenizer" and folder and os.path.isdir(folder)
    return Loaded(args, tensors, folder if is_hf_folder else None, int(args.get("iteration") or 0))


# ----------------------------------------------------------------------------------------
# Savers
# ----------------------------------------------------------------------------------------


def _token_ids(loaded: Loaded) -> dict:
    """bos/eos/pad ids for config.json, from the source's Hugging Face tokenizer when there is one;
    else unset (GPT2Config's default 50256 would name a token outside a smaller vocabulary)."""
    if loaded.tokenizer_dir is None:
        return {"bos_token_id": None, "eos_token_id": None}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir, local_files_only=True)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    ids["pad_token_id"] = tokenizer.pad_token_id
    return {k: v for k, v in ids.items() if v is not None}


def save_hf(loaded: Loaded, save_dir: str, keep_vocab_padding: bool = False) -> list[str]:
    """A Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads; returns the tokenizer
    files written (none when the source has no Hugging Face tokenizer).

    By default the embedding (and lm_head) keep the tokenizer's rows only. Megatron-LM's softmax
    also spans the padding rows, so a trained model's padding logits hold some probability; with
    ``keep_vocab_padding`` they are written too (config vocab_size = the padded size) and
    transformers' loss equals ours exactly."""
    args = loaded.args
    if keep_vocab_padding:
        args = dict(args, vocab_size=loaded.tensors["embedding.word_embeddings.weight"].shape[0])
    hf_state, config = hf.megatron_to_hf(loaded.tensors, args, _token_ids(loaded))
    hf.save_hf_checkpoint(save_dir, hf_state, config)
    return copy_tokenizer_files(loaded.tokenizer_dir, save_dir) if loaded.tokenizer_dir else []


def check_layout(stored: dict, tp: int, pp: int, ep: int = 1) -> None:
    """Refuse a target layout megatron-core cannot build for this model, naming the flag. Experts split
    over EP and, at Megatron-LM's default expert TP (= TP), their FFN over TP."""
    experts = stored.get("num_experts")
    for what, count in (
        ("num_attention_heads", stored["num_attention_heads"]),
        ("num_query_groups", stored["num_query_groups"] if stored.get("group_query_attention") else None),
        ("ffn_hidden_size", stored["ffn_hidden_size"]),
        ("moe_ffn_hidden_size", stored.get("moe_ffn_hidden_size") if experts else None),
    ):
        if count is not None and count % tp:
            raise hf.ConversionError(f"--target-tensor-parallel-size {tp} does not divide {what}={count}")
    if stored.get("multi_latent_attention") and tp != 1:  # as training/arguments/validate.py
        raise hf.ConversionError(f"--target-tensor-parallel-size {tp}: multi-latent attention runs at TP 1 only")
    if stored["num_layers"] % pp:
        raise hf.ConversionError(
            f"--target-pipeline-parallel-size {pp} does not divide num_layers={stored['num_layers']}"
        )
    if ep != 1 and not experts:
        raise hf.ConversionError(f"--target-expert-parallel-size {ep}: the model has no experts (num_experts unset)")
    if experts and experts % ep:
        raise hf.ConversionError(f"--target-expert-parallel-size {ep} does not divide num_experts={experts}")


def _repad_vocab(stored: dict, tensors: dict, tp: int) -> dict:
    """Embedding and output rows padded as Megatron-LM pads them at TP=``tp`` (to a multiple of
    --make-vocab-size-divisible-by x TP, or of the divisor alone with
    --mfsdp-vocab-padding-independent-of-tp); padding rows are zeros."""
    from ..data.datasets import padded_vocab_size

    vocab = true_vocab_size(stored)
    divisor = stored.get("make_vocab_size_divisible_by") or 128
    rows = padded_vocab_size(vocab, divisor, 1 if stored.get("mfsdp_vocab_padding_independent_of_tp") else tp)
    out = dict(tensors)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            t = out[name][:vocab]
            out[name] = torch.cat([t, t.new_zeros(rows - vocab, *t.shape[1:])])
    stored["padded_vocab_size"] = rows
    return out


def save_mfsdp(loaded: Loaded, save_dir: str, tp: int = 1, pp: int = 1, ep: int = 1) -> str:
    """Our torch_dist checkpoint. The tensors are written at 1 x 1 x 1 (dist_checkpointing reshards
    on load; experts under megatron-core's keys with an expert axis, read at any EP); ``tp``/``pp``/``ep``
    set the stored --tensor/--pipeline/--expert-model-parallel-size (what --use-checkpoint-args resumes
    at) and the vocabulary padding of that TP. A source Hugging Face tokenizer is copied beside the
    checkpoint and named by the stored --tokenizer-* flags."""
    args = dict(loaded.args)
    check_layout(hf.transformer_args(args), tp, pp, ep)
    tensors = _repad_vocab(args, loaded.tensors, tp)
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, iteration=loaded.iteration)
    if args.get("num_experts"):
        args.update(expert_model_parallel_size=ep)
    if loaded.tokenizer_dir is not None:
        target = os.path.abspath(os.path.join(save_dir, TOKENIZER_SUBDIR))
        if os.path.abspath(loaded.tokenizer_dir) != target:
            copy_tokenizer_files(loaded.tokenizer_dir, target)
        args.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=target)
    return write_model_checkpoint(save_dir, args, tensors, loaded.iteration)


def cast(loaded: Loaded, dtype: torch.dtype) -> Loaded:
    """Floating tensors in ``dtype`` and the args' --bf16/--fp16 to match (Megatron-LM's loaders' --bf16 and
    --fp16: load the weights in that dtype)."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in loaded.tensors.items()}
    flags = DTYPE_FLAGS.get(dtype, {"bf16": False, "fp16": False})
    return dataclasses.replace(loaded, args={**loaded.args, **flags}, tensors=tensors)


def convert(loader: str, saver: str, load_dir: str, save_dir: str, **options) -> Loaded:
    """Run one conversion. ``options``: base_args, make_vocab_size_divisible_by (hf loader), step,
    true_vocab_size (mfsdp loader), target_tp, target_pp, target_ep (mfsdp saver), keep_vocab_padding (hf saver),
    dtype (cast the loaded weights), tokenizer_dir (hf loader: where the tokenizer files are).
    ``loader``/``saver`` may be Megatron-LM's names (``resolve``)."""
    loader, saver = resolve("loader", loader)[0], resolve("saver", saver)[0]
    if loader == "hf":
        divisor = options.get("make_vocab_size_divisible_by") or 128
        loaded = load_hf(load_dir, options.get("base_args"), divisor)
        if options.get("tokenizer_dir") is not None:  # Megatron-LM's --tokenizer-model: the tokenizer's folder
            if not os.path.isdir(options["tokenizer_dir"]):
                raise hf.ConversionError(f"--tokenizer-model {options['tokenizer_dir']}: not a folder")
            loaded.tokenizer_dir = options["tokenizer_dir"]
    elif loader == "mfsdp":
        loaded = load_mfsdp(load_dir, options.get("step"), options.get("true_vocab_size"))
    else:
        raise hf.ConversionError(f"--loader {loader!r}: choose mfsdp or hf")
    if options.get("dtype") is not None:
        loaded = cast(loaded, options["dtype"])
    tp, pp, ep = (options.get(k) or 1 for k in ("target_tp", "target_pp", "target_ep"))
    if saver == "hf":
        if (tp, pp, ep) != (1, 1, 1):
            raise hf.ConversionError("--target-tensor/pipeline/expert-parallel-size apply to --saver mfsdp only")
        save_hf(loaded, save_dir, bool(options.get("keep_vocab_padding")))
    elif saver == "mfsdp":
        save_mfsdp(loaded, save_dir, tp, pp, ep)
    else:
        raise hf.ConversionError(f"--saver {saver!r}: choose mfsdp or hf")
    return loaded
