"""The trained model in Hugging Face format: `final/` at the end of a run, and `accum-export`
from a checkpoint (weights checked, written beside and renamed into place, in the dtype asked for)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from accum_cli.errors import UserError
from accum_cli.model import lora
from accum_cli.rundir import lora_export, outdir, safe_dcp
from accum_cli.rundir.checkpoint import chmod_as_umask, dcp_load
from accum_cli.rundir.checkpoint_meta import read_meta

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def declared_dtype(config) -> torch.dtype:
    """The dtype a model's config declares (`dtype` in transformers 5, `torch_dtype` before);
    fp32 when it declares none or one we do not export (a model built from a bare config)."""
    for key in ("dtype", "torch_dtype"):
        value = vars(config).get(key)
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if value in EXPORT_DTYPES.values():
            return value
    return torch.float32


def resolve_export_dtype(choice: str, config) -> torch.dtype:
    """--export-dtype: auto is the dtype of the config the model was loaded from."""
    return declared_dtype(config) if choice == "auto" else EXPORT_DTYPES[choice]


def stamp_dtype(folder: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the dtype of the module's (fp32 master) parameters, not of the
    tensors it was handed: write the exported one into config.json."""
    path = folder / "config.json"
    record = json.loads(path.read_text())
    key = "torch_dtype" if "torch_dtype" in record and "dtype" not in record else "dtype"
    record[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def follow_umask(tree: Path) -> None:
    """mkdtemp makes 0700 folders and transformers writes 0600 safetensors: give a published
    model the modes every other file gets (0666/0777 less the umask), so colleagues on a
    shared filesystem can read it."""
    mask = os.umask(0)
    os.umask(mask)
    tree.chmod(0o777 & ~mask)
    for path in tree.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def save_final(model: nn.Module, tokenizer, out_dir: Path, is_main: bool, dtype: torch.dtype) -> None:
    """Gather the full weights (a collective) and let rank 0 write HF format atomically, in
    `dtype` (the fp32 master weights cast once, at the end)."""
    adapters = lora.adapted(model)  # final/ is then a peft adapter folder: the adapters alone are gathered
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters)
    state = get_model_state_dict(model, options=options)
    if not is_main:
        return
    # Gathered shards are separate tensors even where the model ties them, so save_pretrained
    # cannot see the tie and would store the tensor twice: keep the name the model stores it as.
    for tied_name in model.get_expanded_tied_weights_keys(all_submodels=True):
        state.pop(tied_name, None)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.is_dir() and not outdir.is_marked(out_dir) and any(out_dir.iterdir()):
        raise FileExistsError(errno.EEXIST, "it holds files accum-train did not write (move them away)", str(out_dir))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        outdir.mark(tmp, "final model")
        with outdir.safetensors_writes():
            if adapters:  # fp32 whatever the export dtype: they are small, and peft computes them in fp32
                lora.save_adapter(model, state, tmp)
            else:
                model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if not adapters:
            stamp_dtype(tmp, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        follow_umask(tmp)
        if out_dir.exists() and outdir.is_marked(out_dir):
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export(
    checkpoint: Path,
    out_dir: Path,
    trust_remote_code: bool = False,
    export_dtype: str = "auto",
    base: str | None = None,
    merge: bool = False,
) -> Path:
    """Consolidate a sharded checkpoint into Hugging Face format, in one process, no GPU, in
    `export_dtype` (auto: the dtype the model's config declares)."""
    meta = read_meta(checkpoint, flag="checkpoint")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"export target {out_dir} is not empty; pass an empty or new folder")
    # transformers reads a folder's config and tokenizer files by name, listed or not (a planted
    # chat_template.jinja would be exported): it reads a private copy of the listed, verified ones.
    with tempfile.TemporaryDirectory(prefix="accum-export-") as listed:
        _export(meta, Path(listed), out_dir, trust_remote_code, export_dtype, base, merge)
    return out_dir


def _export(meta, listed: Path, out_dir: Path, trust_remote_code: bool, export_dtype: str, base, merge) -> None:
    """export's work, the config and tokenizer read from `listed`: copies of the files meta.json lists."""
    try:  # config and tokenizer files are read by transformers: verified, then verified as copied
        for name in meta.files:
            if not name.endswith(".distcp") and name != ".metadata":
                safe_dcp.verify_file(meta.path, name, meta.files)
                shutil.copyfile(meta.path / name, listed / name)
                safe_dcp.verify_file(listed, name, meta.files)
    except safe_dcp.UnsafeCheckpoint as exc:
        raise safe_dcp.as_user_error(exc, meta.path, "checkpoint") from None
    except OSError as exc:  # the temporary folder's disk
        raise UserError(f"export: cannot copy the checkpoint's files to read them ({exc.strerror or exc})") from None
    if lora_export.is_lora(meta):
        model, adapters, config = lora_export.prepare(meta, listed, base, trust_remote_code)
        if merge:
            dtype = resolve_export_dtype(export_dtype, config)
            write = _saver(lora.merged(model).to(dtype), dtype)
        else:  # a peft adapter folder, as a run's final/ (fp32)

            def write(folder: Path) -> None:
                lora.save_adapter(model, adapters, folder)
    else:
        if merge or base is not None:
            raise UserError(
                f"checkpoint {meta.path} holds a whole model, not LoRA adapters: leave --merge and --base out"
            )
        write = _full_model(meta, listed, trust_remote_code, export_dtype)
    _write(write, listed, out_dir, trust_remote_code)


def _full_model(meta, listed: Path, trust_remote_code: bool, export_dtype: str):
    """A whole model's checkpoint loaded: what writes it into a folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # an unknown or non-causal model type, or code the checkpoint's config asks to run
        config = AutoConfig.from_pretrained(listed, trust_remote_code=trust_remote_code)
        dtype = resolve_export_dtype(export_dtype, config)  # before from_config records fp32 in it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"checkpoint {meta.path}: its model cannot be built ({reason}); export it with the accum-train "
            "and --trust-remote-code it was trained with"
        ) from None
    state = {"model": model.state_dict()}
    dcp_load(state, meta, "checkpoint", no_dist=True)
    model.load_state_dict(state["model"])
    return _saver(model.to(dtype), dtype)


def _saver(model, dtype: torch.dtype):
    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        stamp_dtype(folder, dtype)

    return write


def _write(write, listed: Path, out_dir: Path, trust_remote_code: bool) -> None:
    """The export written beside out_dir, then renamed into place."""
    from transformers import AutoTokenizer

    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    if outdir.someone_elses(tmp):
        raise UserError(f"export: {tmp} exists and is not accum-train's; move it away or pick another target")
    if tmp.exists():  # an earlier export of ours that was interrupted
        shutil.rmtree(tmp)
    created = False
    try:
        tmp.mkdir(parents=True)
        created = True
        outdir.mark(tmp, "export")
        with outdir.safetensors_writes():
            write(tmp)
        with contextlib.suppress(OSError, ValueError, TypeError):  # a model trained without a tokenizer
            # Never the code a checkpoint may ship, nor transformers' question whether to run it.
            AutoTokenizer.from_pretrained(listed, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        for written in tmp.glob("*.safetensors"):
            chmod_as_umask(written)
        (tmp / outdir.MARKER).unlink()  # the exported model is the user's from here on
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException as exc:  # Ctrl-C and a full disk alike leave no half-written folder
        if created:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise UserError(
                f"export to {out_dir} failed ({exc.strerror or exc}); check its space and permissions"
            ) from None
        raise
