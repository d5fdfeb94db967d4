"""`finetune()`: train or fine-tune from a notebook cell (or any Python caller), in this process.

    from zerotrain.launcher import finetune
    result = finetune(model="hf/llama-dir" | "runs/RUN" | "debug", data="mix.json" | "docs.jsonl",
                      max_steps=200, lr=2e-5, seq_len=1024, micro_batch=4)
    result.run_dir, result.metrics          # the run directory, metrics.jsonl's records
    result.export("hf-out")                  # a Hugging Face Llama directory (launcher/commands/export.py)
    result.generate("Question: ...", max_new_tokens=64)   # greedy, with the trained weights

Keyword arguments are the driver's flags (launcher/config.py RunConfig: same names with
underscores, same defaults except `profile="auto"`, same validation and error lines), plus:
- `model=`: a Hugging Face Llama directory (`--init-from`, with its tokenizer as on the command line:
  its tokenizer.json unless `tokenizer=` is given; launcher/model_spec.py), a zerotrain run
  directory (its best checkpoint, else its newest complete one, exported once with the run's tokenizer
  to OUT/.base-models/RUN-PATHHASH-TAG and used as `--init-from`), or a preset name.
- `data=`: a mix JSON file or a prepared shard directory as for the driver; a single data file
  (.jsonl, .parquet, .txt, .arrow) is wrapped into a one-source mix (OUT/.mixes/): documents, or
  for a .jsonl of {"prompt", "response"} / {"messages"} records supervised fine-tuning data.
- `launch=True, gpus=N`: the same job under the `deepspeed` launcher on N local ranks, as a
  subprocess whose output is streamed here; the recipe is written to RUN_DIR/recipe.json.

Without `launch`, the run is a world of 1 in this process (zerotrain.launcher.trainer.run sets the
distributed environment itself; a second call reuses the process group), so it can be called
again with another model or data. Bad input raises one UsageError / DataError carrying the line
the CLI prints; a run that diverges or cannot save raises RunFailed; nothing calls sys.exit.

`from zerotrain.launcher import finetune` gives this module, which is callable as the function: a module
and a function of the same name in one package cannot both be `zerotrain.launcher.commands.finetune` (importing the
module rebinds the package attribute to it), so the module answers the call itself.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain import durable
from zerotrain.dataio.format.errors import first_line
from zerotrain.dataio.sources.sft import ChatRenderer
from zerotrain.dataio.sources.tokenizer import load_tokenizer
from zerotrain.launcher import model_spec
from zerotrain.launcher.commands import export as export_command
from zerotrain.launcher.commands.export import consolidated_state_dict, find_checkpoint, live_model
from zerotrain.launcher.components.launching.jobs import (RANK_VARS, TRAIN_MODULE, deepspeed_runner,
                                                          run_preserving_exit_code)
from zerotrain.launcher.components.launching import ports
from zerotrain.launcher.components.launching.ports import rendezvous_port
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.components.observe.metrics import read_metrics
from zerotrain.launcher.config_resolve import config_from
from zerotrain.launcher.ends import END_KINDS, EXIT_USAGE, kind_of_exit
from zerotrain.launcher.errors import UsageError, ZerotrainError
from zerotrain.launcher.node import Node
from zerotrain.launcher.run_plan import identify, plan_run
from zerotrain.launcher.settings import INIT_FROM
from zerotrain.launcher.trainer import run
from zerotrain.modeling import hf
from zerotrain.modeling.initial import weights_loaded_after
from zerotrain.modeling.model import Transformer
from zerotrain.modeling.sizes import PRESETS, ModelArgs

DATA_FILE_SUFFIXES = (".jsonl", ".parquet", ".txt", ".arrow")
FINETUNE_DEFAULTS = {"profile": "auto"}  # a notebook runs on whatever this machine has


class RunFailed(ZerotrainError):
    """The run ended with an error after it started (diverged, checkpoint write failed, crashed);
    `.result` is the FinetuneResult (its run directory holds the last good checkpoint)."""

    def __init__(self, message: str, result: "FinetuneResult"):
        super().__init__(message)
        self.result = result


@dataclass
class FinetuneResult:
    """A finished run: where it is, how it ended, and its trained weights."""
    run_dir: Path
    stop: str  # the end kind: a key of launcher/ends.py END_KINDS (finished, budget, signal, diverged, ...)
    exit_code: int
    message: str
    checkpoint: Path | None  # the last complete checkpoint: the trained weights
    _model: tuple | None = field(default=None, repr=False)

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def export(self, out: str | Path, dtype: str = "float32", max_shard_size: int | str = "5GB",
               check: bool = True) -> Path:
        """The trained weights as a Hugging Face Llama directory (`zerotrain export`: sharded at
        `max_shard_size`, checked against the checkpoint unless check=False; a failed check raises
        zerotrain.launcher.commands.export.ExportCheckFailed)."""
        if self.checkpoint is None:
            raise UsageError(f"export {self.run_dir}: the run has no complete checkpoint")
        done = export_command.export(self.checkpoint, Path(out), dtype, max_shard_size=max_shard_size, check=check)
        print(f"exported {done['checkpoint']} -> {out}")
        if done["check"] is not None:
            print(export_command.check_line(done["check"]))
        return Path(out)

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 64, add_special_tokens: bool = True) -> str:
        """Greedy continuation of `prompt` (a text, or a chat's messages) by the trained weights (CPU); the new
        text only (finetune.greedy)."""
        if self.checkpoint is None:
            raise UsageError(f"generate: {self.run_dir} has no complete checkpoint")
        if self._model is None:
            self._model = load_model(self.checkpoint)
        return greedy(*self._model, prompt, max_new_tokens, add_special_tokens)


def finetune(model: str | Path | None = None, data: str | Path | None = None, *, launch: bool = False,
             gpus: int | None = None, **flags) -> FinetuneResult:
    """Train `model` on `data` with the driver's flags as keyword arguments (see the module docstring)."""
    written = []  # the mix file this call wrote and the directories it made for it, deepest first
    try:
        # None means "not given", as for a flag left out; paths may come as Path objects
        values = {**FINETUNE_DEFAULTS, **{k: str(v) if isinstance(v, Path) else v for k, v in flags.items()
                                          if v is not None}}
        out = Path(values.get("out", "runs"))
        if model is not None:
            values.update(model_values(model, values, out))
        mix = None
        if data is not None:
            values["data"], mix = data_spec(data, out)
        cfg = config_from(values)
        if mix is not None and (with_bos := with_tokenizer_bos(mix, cfg)) != mix:
            # another mix, so a file (and a run) of its own: a call with another model never rewrites the mix
            # a run of this file recorded
            values["data"], mix = str(Path(values["data"]).with_suffix("")) + "-bos.json", with_bos
            cfg = config_from(values)
        if mix is not None:  # written only once the settings are known to be good
            path = Path(cfg.data.path)
            if not path.is_file():
                written = [path, *(d for d in path.parents if not d.exists())]
            write_if_changed(path, mix)
        if launch:
            return _launch(cfg, gpus)
        if gpus not in (None, 1):
            raise UsageError(f"gpus={gpus}: this process is one rank; more than one needs launch=True")
        result = run(cfg, hard_exit=False)  # a second interrupt must not kill the kernel
    except UsageError as e:  # DataError too: the CLI's one line, without the driver's stack under it
        for made in written:  # bad input writes nothing: the mix this call wrote goes, and its new folders
            with contextlib.suppress(OSError):
                made.unlink() if made.is_file() else made.rmdir()
        raise e.with_traceback(None) from None
    finally:
        gc.collect()  # the engine of this run is unreachable now: give its memory back before the next
    done = FinetuneResult(run_dir=Path(result.run_dir), stop=result.stop, exit_code=result.exit_code,
                          message=result.message, checkpoint=result.last_checkpoint or _newest(result.run_dir))
    if END_KINDS[result.stop].failed:
        raise RunFailed(result.message, done)
    return done


# -- model= and data= --------------------------------------------------------------------------

def model_values(model: str | Path, values: dict, out: Path) -> dict:
    """The flags `model=` stands for: {"model": preset} or {"init_from": HF dir or hub name ORG/NAME[@REV]}."""
    where = f"model {model}"
    path = Path(model).expanduser()
    given = [k for k in ("init_from", "depth", "scaling_rule", "model") if values.get(k) is not None]
    if given:
        raise UsageError(f"model= and {given[0]}=: give one way to pick the model")
    if path.is_dir():  # its tokenizer, as --init-from's (launcher/model_spec.py init_from_tokenizer)
        if (path / "checkpoints").is_dir() or _run_config(path) is not None:
            return {"init_from": str(base_from_run(path, out))}
        if (path / "config.json").is_file():  # model_spec checks it is a Llama directory with safetensors
            return {"init_from": str(path)}
        raise UsageError(f"{where}: neither a Hugging Face Llama directory (no config.json) nor a zerotrain run"
                         " directory (no checkpoints/)")
    if path.exists():
        raise UsageError(f"{where}: a file; expected a Hugging Face Llama directory, a zerotrain run directory or"
                         f" a preset ({', '.join(PRESETS)})")
    if str(model) in PRESETS:
        return {"model": str(model)}
    if model_spec.hub_model_name(str(model)):  # found in (or fetched into) the Hugging Face cache as --init-from's
        return {"init_from": str(model)}
    raise UsageError(f"{where}: no such directory, not a preset ({', '.join(PRESETS)}) and not a hub name"
                     " ORG/NAME[@REVISION]")


def _run_config(run_dir: Path) -> dict | None:
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and "run" in saved and "model" in saved else None


def best_or_newest(run_dir: Path) -> tuple[Path, str]:
    """(checkpoint, why): the run's best checkpoint (checkpoints/best.json) if it is complete, else its newest."""
    best = checkpoint.read_best(run_dir / "checkpoints")
    if best is not None:
        tag = run_dir / "checkpoints" / best["tag"]
        if (tag / checkpoint.MARKER).is_file():
            return tag, f"best, val_loss {best.get('val_loss')}"
    tag, _ = find_checkpoint(run_dir)
    return tag, "newest" + (f"; best.json names {best['tag']}, which is not complete" if best else "")


def base_from_run(run_dir: Path, out: Path) -> Path:
    """A run's chosen checkpoint as a Hugging Face directory under OUT/.base-models (exported once, with the
    run's tokenizer). The directory must outlive this call: every resume of the fine-tune re-reads
    --init-from, and its path is part of the fine-tune's run id."""
    saved = _run_config(run_dir)
    if saved is None:
        raise UsageError(f"model {run_dir}: a run directory without a readable config.json")
    tag, why = best_or_newest(run_dir)
    # named by the run's whole path, not its name alone: two runs of one name (runs/gqa, other/gqa) are two models
    where = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    hf_dir = out / ".base-models" / f"{run_dir.resolve().name}-{where}-{tag.name}"
    weights = (hf_dir / hf.SINGLE_FILE, hf_dir / hf.INDEX_FILE)  # one file, or shards and their index
    if not ((hf_dir / "config.json").is_file() and any(w.is_file() for w in weights)):
        hf_dir.parent.mkdir(parents=True, exist_ok=True)
        with quiet_stderr():  # read back by our own loader (hf.load_weights), not transformers: no check
            export_command.export(tag, hf_dir, check=False)
    print(f"model {run_dir}: checkpoint {tag.name} ({why}) as {hf_dir}")
    return hf_dir


def data_spec(data: str | Path, out: Path) -> tuple[str, str | None]:
    """(what the driver's --data gets, the text of a mix file to write there or None).

    A mix file or shard directory goes as is; a single data file is wrapped into a one-source mix,
    at a path fixed by the file's own path (so the run id stays the same from call to call). A
    .jsonl whose first record has "messages", or "prompt" and "response", is supervised
    fine-tuning data (dataio/sources/sft.py: "format": "chat" / "sft", loss on the responses only);
    other field names or settings need a mix file.
    """
    path = Path(data).expanduser()
    if path.suffix not in DATA_FILE_SUFFIXES or not path.is_file():
        return str(data), None  # a mix, a shard directory, or a missing path: the driver's checks and lines
    source = {"name": path.stem, "path": str(path.resolve()), "weight": 1.0, **_record_format(path)}
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return str(out / ".mixes" / f"{path.stem}-{digest}.json"), json.dumps({"sources": [source]}, indent=2) + "\n"


def with_tokenizer_bos(mix: str, cfg) -> str:
    """A wrapped file of documents (not SFT) gets "bos": true when the run's tokenizer is one transformers puts
    a BOS before every text with (a Llama's): the fine-tune then trains as the model was trained and as
    transformers would encode the file (the driver only warns, for a mix the user wrote)."""
    raw = json.loads(mix)
    (source,) = raw["sources"]
    if "format" in source or not getattr(identify(cfg).tokenizer, "adds_bos", False):
        return mix
    source["bos"] = True
    return json.dumps(raw, indent=2) + "\n"


def _record_format(path: Path) -> dict:
    """{"format": "chat" | "sft"} from a .jsonl's first record, {} for documents (or anything
    unreadable: the driver reports it with the source and line)."""
    if path.suffix != ".jsonl":
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        record = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if isinstance(record, dict) and "messages" in record:
        return {"format": "chat"}
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        return {"format": "sft"}
    return {}


def write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_text(path, text)  # the mix the run reads (and a resume reads again)


def quiet_stderr():
    """DeepSpeed's zero_to_fp32 draws two progress bars on stderr for every consolidation."""
    return contextlib.redirect_stderr(io.StringIO())


def _newest(run_dir) -> Path | None:
    done = checkpoint.complete_checkpoints(Path(run_dir) / "checkpoints")
    return done[-1] if done else None


# -- launch=True -------------------------------------------------------------------------------

def _launch(cfg, gpus: int | None) -> FinetuneResult:
    """The same run under the deepspeed launcher on `gpus` local ranks; output streamed here."""
    if gpus is None:
        gpus = Node.here().count
        if gpus < 1:
            raise UsageError("launch=True: no GPU found here; give gpus=N (N CPU ranks work too, slowly)")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise UsageError(f"gpus={gpus!r}: must be a positive integer")
    plan = plan_run(cfg, world=gpus, rank=0)  # every check the ranks will make, before anything starts
    # a value taken from --init-from is left for the ranks to take again, with its source
    recipe = {k: v for k, v in cfg.to_dict().items() if v is not None and (cfg.sources or {}).get(k) != INIT_FROM}
    recipe["run_id"] = plan.run_dir.name  # fixed, so the ranks' run directory is the one planned here
    if cfg.parallel.profile == "auto":
        recipe["profile"] = plan.profile_name  # the ranks do not detect again
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = plan.run_dir / "recipe.json"
    durable.write_json(recipe_path, recipe)  # what the launched ranks read
    port = rendezvous_port(None)[0]  # claimed: another launch starting now takes another
    cmd = [*deepspeed_runner(), "--num_gpus", str(gpus), "--master_port", str(port), "--module", TRAIN_MODULE,
           "--config", str(recipe_path)]
    print(f"launching {gpus} rank(s): {' '.join(cmd)}", flush=True)
    tail = []

    def relay(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        tail.append(text)
        del tail[:-50]

    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    try:
        code = run_preserving_exit_code(cmd, env=env, relay=relay)
    finally:
        ports.release(port)  # the notebook's kernel lives on: the port is another launch's again
    lines = "".join(tail).splitlines()
    errors = [ln.removeprefix("zerotrain: error: ") for ln in lines if ln.startswith("zerotrain: error: ")]
    kind = kind_of_exit(code)  # 0 reads as "finished": the ranks' own result is not returned across the launch
    result = FinetuneResult(run_dir=plan.run_dir, stop=kind, exit_code=code,
                            message=errors[-1] if errors else f"exit {code}", checkpoint=_newest(plan.run_dir))
    if code == EXIT_USAGE:
        raise UsageError(result.message)
    if END_KINDS[kind].failed:
        raise RunFailed(result.message if errors else f"the launched run exited {code}; its output is above", result)
    return result


# -- generation --------------------------------------------------------------------------------

def load_model(source: str | Path, tokenizer: str | None = None):
    """(Transformer on CPU in eval mode, tokenizer) from a checkpoint, a run directory (its newest
    checkpoint) or a Hugging Face Llama directory (`tokenizer=` when it has no tokenizer.json). The model's
    `trained_bos`: its run's documents began with BOS (a mix's "bos": true; `greedy` puts it before a prompt);
    its `stop_ids`: the ids generation ends at (the tokenizer's EOS, and the end-of-text list of the model's
    generation_config.json: a chat model's end of turn, Llama 3 Instruct's <|eot_id|>)."""
    source = Path(source)
    trained_bos = False  # a Hugging Face directory: its tokenizer says (encode_as_transformers)
    if (source / checkpoint.MARKER).is_file() or (source / "checkpoints").is_dir():
        tag, run_dir = find_checkpoint(source)
        saved = _run_config(run_dir)
        if saved is None:
            raise UsageError(f"generate {source}: no readable {run_dir / 'config.json'}")
        with quiet_stderr():
            state = consolidated_state_dict(tag)
        model = live_model(state, ModelArgs(**saved["model"]), f"generate {tag}")
        tok = load_tokenizer(tokenizer) if tokenizer else \
            export_command.run_tokenizer(saved, run_dir / "config.json", f"generate {source}")
        trained_bos = any(s.get("bos") for s in saved.get("sources") or [])
        generation_config = None if tokenizer else export_command.base_generation_config(saved)
    else:
        try:
            cfg = hf.read_config(source)
            args = hf.args_from_config(cfg, f"generate {source}")
            hf.check_weights(source, args)
            with weights_loaded_after():  # load_weights writes every value next
                model = Transformer(args)
            hf.load_weights(model, source)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if tokenizer is None and not (source / "tokenizer.json").is_file():
            raise UsageError(f"generate {source}: no tokenizer.json in the directory; give tokenizer=")
        tok = load_tokenizer(tokenizer or str(source))
        generation_config = source / "generation_config.json"
    model.eval()
    model.trained_bos = trained_bos
    model.stop_ids = {tok.eos_id} | _end_ids(generation_config)
    return model, tok


def _end_ids(generation_config: Path | None) -> set[int]:
    """A generation_config.json's eos_token_id (an id or a list of them); none where there is no such file."""
    try:
        eos = json.loads(generation_config.read_text()).get("eos_token_id") if generation_config else None
    except (OSError, ValueError, AttributeError):  # no file, not JSON, not an object: the tokenizer's EOS alone
        return set()
    return {i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int) and not isinstance(i, bool)}


def _prompt_ids(tokenizer, prompt, add_special_tokens: bool) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the ids that end the reply where the chat template writes an end of turn: [] for a text)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode_as_transformers(prompt) if add_special_tokens else tokenizer.encode(prompt)
        bos = tokenizer.bos_id
        return (ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids), []  # a text that begins with BOS
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)):
        raise UsageError("generate: the prompt must be a text or a list of messages ({\"role\": ..., \"content\": ...})")
    renderer = ChatRenderer(tokenizer)
    try:
        text = renderer.render([prompt], [True])[0]
        mark = "\u2063zerotrain-reply\u2063"  # the reply's text, to find what the template writes after it
        turn = renderer.render([[*prompt, {"role": "assistant", "content": mark}]], [False])[0]
    except Exception as e:  # a template's own raise_exception (jinja2 TemplateError) and the like
        raise UsageError(f"generate: {renderer.name} refused the messages: {first_line(e)}") from None
    end = turn.split(mark, 1)[1].rstrip() if mark in turn else ""
    # as transformers' apply_chat_template(tokenize=True): the rendered text, no special tokens added to it
    return tokenizer.encode(text), tokenizer.encode(end) if end else []


def greedy(model, tokenizer, prompt: str | list[dict], max_new_tokens: int = 64, add_special_tokens: bool = True) -> str:
    """The most likely next token, again and again, until an end (`model.stop_ids`, load_model's; else the
    tokenizer's EOS) or `max_new_tokens` (no cache: the models here are small and so are the prompts); the new
    text. A text prompt is encoded as transformers' tokenizer(prompt, add_special_tokens=...) encodes it (a Llama's
    BOS first; a chat-rendered text that begins with BOS gets no second one), with the BOS a run's documents began
    with (`model.trained_bos`) where that adds none. A list of messages is rendered by the tokenizer's chat template
    with the assistant's turn opened (the plain ChatML one for a tokenizer without), as apply_chat_template does,
    and the reply ends where the template ends a turn. Ids past the tokenizer's are never produced by our own
    models (their vocabulary is padded); an imported model's rows are all its own, as in transformers."""
    ids, turn_end = _prompt_ids(tokenizer, prompt, add_special_tokens)
    ids = list(ids)
    if getattr(model, "trained_bos", False) and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id, *ids]
    if not ids:
        raise UsageError("generate: the prompt encodes to no tokens")
    stop = getattr(model, "stop_ids", None) or {tokenizer.eos_id}
    rows = tokenizer.vocab_size if model.args.vocab_multiple_of > 1 else model.args.vocab_size
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = (ids + new)[-model.args.max_seq_len:]
            token = int(model(torch.tensor([window]))[0, -1, :rows].argmax())
            if token in stop:
                break
            new.append(token)
            if turn_end and new[-len(turn_end):] == turn_end:
                new = new[:-len(turn_end)]
                break
    return tokenizer.decode(new)


def generate(model: str | Path, prompt: str | list[dict], max_new_tokens: int = 64, tokenizer: str | None = None,
             add_special_tokens: bool = True) -> str:
    """Greedy continuation by a checkpoint, run directory or Hugging Face directory (e.g. before fine-tuning);
    `prompt` a text or a chat's messages (`greedy`)."""
    return greedy(*load_model(model, tokenizer), prompt, max_new_tokens, add_special_tokens)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> FinetuneResult:
        return finetune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
