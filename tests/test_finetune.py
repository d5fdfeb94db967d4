"""`finetune()`: the driver as a Python call in this process, callable again and again
without keeping earlier runs in memory; `model=` as a Hugging Face directory, a run directory or
a preset; errors as one exception with the CLI's line; export and greedy generation; and the
same job under the deepspeed launcher (`launch=True`)."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import traceback
from pathlib import Path

import pytest

from conftest import write_mix

from zerotrain.launcher.errors import DataError, UsageError

TRAIN = dict(seq_len=64, micro_batch=1, max_steps=2, warmup_steps=1, log_data_every_steps=0)
# The leak this guards against was ~250 MB per call for the 14M-parameter model below (RSS 785,
# 1042, 1069, 1312 MB after four calls: every engine with its optimizer state and gradients kept
# alive by DeepSpeed's tensor hooks and two ZeRO-3 globals); fixed, 544, 539, 545, 549 MB.
RSS_GROWTH_BOUND_MB = 120


def write_llama_dir(path: Path, dim: int = 512, layers: int = 4) -> Path:
    """A randomly initialised Llama-format directory (no tokenizer.json): 14M parameters."""
    import torch

    from zerotrain.modeling import hf
    from zerotrain.modeling.model import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=8, max_seq_len=256)
    hf.save(path, Transformer(args).state_dict(), args, bos_id=256, eos_id=257)
    return path


def rss_mb() -> float:
    """Resident memory after handing freed heap back to the system (glibc keeps freed chunks, so
    without malloc_trim the peak of a checkpoint consolidation would read as growth)."""
    import ctypes

    import psutil

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module", autouse=True)
def _leave_no_process_group():
    """An in-process run makes this pytest process rank 0 of a world of 1 (environment and process
    group): undo it, so later tests' launches do not inherit RANK or MASTER_PORT."""
    from zerotrain.launcher.components.launching.jobs import RANK_VARS

    saved = {k: os.environ.get(k) for k in RANK_VARS}
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_three_calls_in_one_process_hf_dir_run_dir_preset(tmp_path, capsys):
    from zerotrain.launcher import finetune
    from zerotrain.launcher.commands.finetune import generate

    llama = write_llama_dir(tmp_path / "llama")
    data = write_mix(tmp_path / "data")
    other = write_mix(tmp_path / "data2", weights=(0.5, 0.5))
    out = tmp_path / "runs"

    # 1. a Hugging Face directory without tokenizer.json whose vocabulary is the byte tokenizer's: bytes, taken
    # from --init-from as on the command line (tests/test_init_from_tokenizer.py: the refusal of any other)
    first = finetune(model=llama, data=data.parent / "prose.jsonl", out=out, **TRAIN)
    rss = [rss_mb()]
    # 2. the run directory: its newest checkpoint, exported once, is the starting point
    second = finetune(model=first.run_dir, data=other, out=out, seed=7, **TRAIN)
    rss.append(rss_mb())
    # 3. a preset from scratch, other data
    third = finetune(model="debug", data=other, out=out, **TRAIN)
    rss.append(rss_mb())
    # Memory stays flat: a run the size of the first reuses what the first freed, so a kept engine
    # shows as growth. (Measured before anything else runs here: export and generate allocate too.)
    print(f"RSS after each call (MB): {[round(r) for r in rss]}")
    assert max(rss[1:]) - rss[0] < RSS_GROWTH_BOUND_MB, rss
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert not [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]  # no engine outlives its run

    assert first.stop == "finished" and first.exit_code == 0
    assert [m["step"] for m in first.metrics] == [1, 2]
    assert first.checkpoint == first.run_dir / "checkpoints" / "global_step2"
    saved = json.loads((first.run_dir / "config.json").read_text())
    assert saved["run"]["init_from"] == str(llama) and saved["tokenizer"] == "bytes"
    assert saved["run_sources"]["tokenizer"] == "init-from"
    wrapped = json.loads(Path(saved["run"]["data"]).read_text())  # a bare .jsonl became a one-source mix
    assert wrapped == {"sources": [{"name": "prose", "path": str(data.parent / "prose.jsonl"), "weight": 1.0}]}
    where = hashlib.sha256(str(first.run_dir.resolve()).encode()).hexdigest()[:8]  # two runs of one name: two bases
    base = out / ".base-models" / f"{first.run_dir.name}-{where}-global_step2"
    assert json.loads((second.run_dir / "config.json").read_text())["run"]["init_from"] == str(base)
    assert third.run_dir.name.startswith("debug-") and [m["step"] for m in third.metrics] == [1, 2]
    assert len({first.run_dir, second.run_dir, third.run_dir}) == 3

    answer = first.generate("the model reads", max_new_tokens=12)
    assert isinstance(answer, str) and answer == first.generate("the model reads", max_new_tokens=12)
    assert generate(base, "the model reads", 12, tokenizer="bytes") == answer  # the trained weights, exactly
    exported = first.export(tmp_path / "hf-out")
    assert (exported / "model.safetensors").is_file()
    assert generate(exported, "the model reads", 12, tokenizer="bytes") == answer
    assert "train: 100%" in capsys.readouterr().out  # the progress bar (tqdm.auto)


def test_bad_input_is_one_exception_with_the_clis_line(tmp_path, capsys):
    from zerotrain.launcher import finetune
    from zerotrain.launcher.train import main

    data = write_mix(tmp_path / "data")
    out = tmp_path / "runs"
    with pytest.raises(SystemExit):  # what the CLI prints for the same flag
        main(["--data", str(data), "--seq-len", "0", "--out", str(out)])
    cli_line = capsys.readouterr().err.strip()
    with pytest.raises(UsageError) as e:
        finetune(model="debug", data=data, seq_len=0, out=out)
    assert cli_line == "zerotrain: error: --seq-len: must be a positive integer, got 0"
    assert f"zerotrain: error: {e.value}" == cli_line
    assert traceback.extract_tb(e.value.__traceback__)[-1].name == "finetune"  # not the driver's stack under it

    cases = [
        (dict(model="no-such-model"), "model no-such-model: no such directory, not a preset (debug, tiny,"),
        (dict(model=str(tmp_path)), f"model {tmp_path}: neither a Hugging Face Llama directory (no config.json)"
                                    " nor a zerotrain run directory (no checkpoints/)"),
        (dict(model=str(data)), f"model {data}: a file; expected a Hugging Face Llama directory"),
        (dict(model="debug", init_from=str(tmp_path)), "model= and init_from=: give one way to pick the model"),
        (dict(model="debug", lerning_rate=1e-3), "unknown setting 'lerning_rate' (see `zerotrain train --help`)"),
        (dict(model="debug", gpus=2), "gpus=2: this process is one rank; more than one needs launch=True"),
        (dict(model="debug", profile="no-such-profile"), "--profile no-such-profile: unknown profile; known:"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UsageError) as e:
            finetune(data=data, out=out, **kwargs)
        assert str(e.value).startswith(message), (kwargs, str(e.value))
    with pytest.raises(DataError, match="no such file"):
        finetune(model="debug", data=tmp_path / "missing.json", out=out)
    gpt2 = tmp_path / "gpt2"  # a model refused when the run is planned, after a single data file was wrapped
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    with pytest.raises(UsageError, match="not a Llama model"):
        finetune(model=gpt2, data=tmp_path / "docs.jsonl", out=out)
    assert not out.exists()  # nothing written for any of them (the wrapped mix neither)


def test_best_checkpoint_else_newest(tmp_path):
    from zerotrain.launcher.commands.finetune import best_or_newest

    ckpts = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        (ckpts / f"global_step{step}").mkdir(parents=True)
        (ckpts / f"global_step{step}" / "zerotrain.json").write_text(json.dumps({"step": step}))
    (ckpts / "best.json").write_text(json.dumps({"tag": "global_step2", "step": 2, "val_loss": 1.5}))
    assert best_or_newest(tmp_path / "run") == (ckpts / "global_step2", "best, val_loss 1.5")
    (ckpts / "global_step2" / "zerotrain.json").unlink()  # best no longer complete: the newest
    tag, why = best_or_newest(tmp_path / "run")
    assert tag == ckpts / "global_step4" and why == "newest; best.json names global_step2, which is not complete"
    (ckpts / "best.json").unlink()
    assert best_or_newest(tmp_path / "run") == (ckpts / "global_step4", "newest")


def test_import_forms():
    import zerotrain.launcher
    import zerotrain.launcher.commands.finetune as module
    from zerotrain.launcher import finetune
    assert finetune is module is zerotrain.launcher.commands.finetune and callable(finetune)
    assert module.finetune.__name__ == "finetune"


@pytest.mark.launches
def test_launch_two_ranks_streams_output_and_writes_the_recipe(tmp_path, capsys, monkeypatch):
    from zerotrain.launcher import finetune
    # as in a notebook after an in-process run: this process is rank 0 of a world of 1
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    from zerotrain.launcher.components.launching import ports

    data = write_mix(tmp_path / "data")
    claimed_before = dict(ports._claimed)  # what other tests in this process claimed
    result = finetune(model="debug", data=data, out=tmp_path / "runs", launch=True, gpus=2, **TRAIN)
    output = capsys.readouterr().out  # what the ranks printed, relayed through sys.stdout
    assert "world 2" in output and f"run directory: {result.run_dir.resolve()}" in output
    assert result.stop == "finished" and [m["step"] for m in result.metrics] == [1, 2]
    recipe = json.loads((result.run_dir / "recipe.json").read_text())
    assert recipe["profile"] == "cpu" and recipe["run_id"] == result.run_dir.name  # auto resolved once, here
    assert json.loads((result.run_dir / "config.json").read_text())["world_size"] == 2
    assert result.checkpoint == result.run_dir / "checkpoints" / "global_step2"
    assert os.environ["WORLD_SIZE"] == "1"  # this process is untouched
    assert ports._claimed == claimed_before  # the rendezvous port's claim ended with the job (the kernel lives on)


def test_a_single_data_file_becomes_a_one_source_mix(tmp_path):
    from zerotrain.dataio.format.mix import parse_mix
    from zerotrain.launcher.commands.finetune import data_spec

    out = tmp_path / "runs"
    records = {"docs": {"text": "a document"}, "qa": {"prompt": "2 + 2?", "response": "4"},
               "chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}}
    for name, record in records.items():
        (tmp_path / f"{name}.jsonl").write_text("\n" + json.dumps(record) + "\n")
    specs = {name: data_spec(tmp_path / f"{name}.jsonl", out) for name in records}
    assert {name: json.loads(text)["sources"][0].get("format") for name, (_, text) in specs.items()} == \
        {"docs": None, "qa": "sft", "chat": "chat"}
    path, text = specs["qa"]
    assert data_spec(tmp_path / "qa.jsonl", out) == (path, text)  # the same path every call: the same run id
    Path(path).parent.mkdir(parents=True)
    Path(path).write_text(text)
    assert [(s.name, s.format) for s in parse_mix(path).sources] == [("qa", "sft")]  # dataio accepts it
    mix = tmp_path / "mix.json"
    assert data_spec(mix, out) == (str(mix), None)  # mix files and shard directories go as they are


def test_a_wrapped_file_of_documents_gets_bos_when_the_tokenizer_puts_one_before_every_text(tmp_path):
    """finetune() wraps a single file for the user: with a tokenizer that transformers puts a BOS before every
    text with (a Llama's), its documents start with BOS, as the model was trained and as transformers would
    encode the file; SFT files are left to their chat template, other tokenizers get nothing."""
    from test_data_bos import bos_tokenizer
    from zerotrain.dataio.sources.tokenizer import train_bpe
    from zerotrain.launcher.commands.finetune import data_spec, with_tokenizer_bos
    from zerotrain.launcher.config_resolve import config_from

    llama_like = bos_tokenizer(tmp_path / "llama")
    plain = train_bpe(["a few words of text"] * 20, 300, tmp_path / "plain")
    out = tmp_path / "runs"
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"prompt": "2 + 2?", "response": "4"}) + "\n")
    for name, tokenizer, bos in [("docs", llama_like.directory, True), ("docs", plain, None),
                                 ("qa", llama_like.directory, None)]:
        path, text = data_spec(tmp_path / f"{name}.jsonl", out)
        cfg = config_from({"data": path, "tokenizer": str(tokenizer), "model": "debug", "out": str(out)})
        assert json.loads(with_tokenizer_bos(text, cfg))["sources"][0].get("bos") is bos, (name, tokenizer)
    # finetune() writes a mix with "bos" to a file of its own: a call with another model (here one refused) never
    # rewrites the mix an earlier run of the same file recorded
    from zerotrain.launcher import finetune

    plain_path, plain_text = data_spec(tmp_path / "docs.jsonl", out)
    Path(plain_path).parent.mkdir(parents=True)
    Path(plain_path).write_text(plain_text)
    with pytest.raises(UsageError, match="--max-epochs"):
        finetune(model="debug", data=tmp_path / "docs.jsonl", tokenizer=str(llama_like.directory), out=out,
                 max_epochs=0.001, max_steps=50, seq_len=64)
    assert Path(plain_path).read_text() == plain_text
    assert sorted(p.name for p in Path(plain_path).parent.iterdir()) == [Path(plain_path).name]  # nothing else


def test_generation_encodes_the_prompt_as_the_model_was_trained():
    """greedy(): the prompt as transformers encodes it (a Llama's tokenizer puts its BOS first, as generation on
    the export does), and a run whose documents began with BOS ("bos": true) gets it where the tokenizer adds
    none (the byte tokenizer's 256)."""
    import tempfile

    import torch

    from test_data_bos import bos_tokenizer
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.commands.finetune import greedy
    from zerotrain.modeling.model import Transformer
    from zerotrain.modeling.sizes import ModelArgs

    seen = []

    class Recorder(Transformer):
        def forward(self, ids, *a, **k):
            seen.append(ids[0].tolist())
            return super().forward(ids, *a, **k)

    torch.manual_seed(0)
    model = Recorder(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=512, max_seq_len=64)).eval()
    byte = ByteTokenizer()
    for trained_bos, first in [(True, [256, 97, 98]), (False, [97, 98])]:
        seen.clear()
        model.trained_bos = trained_bos  # what load_model sets from the run's mix
        greedy(model, byte, "ab", max_new_tokens=1)
        assert seen[0] == first
    with tempfile.TemporaryDirectory() as tmp:
        llama = bos_tokenizer(Path(tmp))
        seen.clear()
        model.trained_bos = False
        greedy(model, llama, "the cat", max_new_tokens=1)
        assert seen[0] == llama.encode_as_transformers("the cat") and seen[0][0] == llama.bos_id
        seen.clear()
        model.trained_bos = True
        greedy(model, llama, "the cat", max_new_tokens=1)  # one BOS, not two
        assert seen[0] == llama.encode_as_transformers("the cat")


def test_weights_with_nan_are_refused_and_leave_nothing_running(tmp_path):
    """--init-from weights holding a NaN are refused once loaded (engine.check_finite) with the one line; the failed
    build leaves no watchdog (in a notebook it would fire later), no lock, and no run directory (this launch made
    it); an existing run directory (a run stopped before its first checkpoint) is left byte for byte as it was."""
    import threading

    from safetensors.torch import load_file, save_file

    from zerotrain.launcher import finetune

    def files(root):
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    llama = write_llama_dir(tmp_path / "llama", dim=64, layers=2)
    data = write_mix(tmp_path / "data")
    out = tmp_path / "runs"
    finetune(model=llama, data=data, out=out, max_steps=1, seq_len=64, micro_batch=2, run_id="kept")
    run = out / "kept"
    shutil.rmtree(run / "checkpoints")  # as if stopped before its first save: the next launch starts afresh in it
    before = files(run)
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(tensors, llama / "model.safetensors", metadata={"format": "pt"})
    for run_id in ("kept", None):
        with pytest.raises(UsageError, match="tensor model.layers.1.self_attn.k_proj.weight holds NaN or infinite"):
            finetune(model=llama, data=data, out=out, max_steps=2, seq_len=64, micro_batch=2, run_id=run_id)
        assert [t.name for t in threading.enumerate() if t.name in ("zerotrain-watchdog", "zerotrain-lock")] == []
    assert files(run) == before and not (run / "checkpoints").exists()
    assert [p.name for p in out.iterdir() if p.is_dir()] == ["kept"]  # the new run's directory: removed


def test_generation_stops_where_the_model_ends_a_turn_and_renders_chats_as_transformers(tmp_path):
    """greedy(): ends at the model's end-of-text ids (generation_config.json's list, read by load_model); a chat's
    messages rendered with the assistant's turn opened and encoded as apply_chat_template(tokenize=True) encodes them,
    the reply cut where the template ends a turn; a chat-rendered text that begins with BOS gets no second one; an
    imported model's rows past its tokenizer's are its own (transformers' argmax), our padded rows never win."""
    import torch

    from test_data_bos import bos_tokenizer
    from zerotrain.dataio.sources.sft import plain_chat
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.commands.finetune import _end_ids, greedy
    from zerotrain.modeling.sizes import ModelArgs

    class Scripted(torch.nn.Module):
        """Puts the highest logit on the next id of `script`; records what it was given."""

        def __init__(self, script, vocab_size=320, vocab_multiple_of=64):
            super().__init__()
            self.args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=vocab_size,
                                  vocab_multiple_of=vocab_multiple_of, max_seq_len=256)
            self.script, self.seen = list(script), []

        def forward(self, ids):
            self.seen.append(ids[0].tolist())
            logits = torch.zeros(1, ids.shape[1], self.args.vocab_size)
            logits[0, -1, self.script[len(self.seen) - 1]] = 1.0
            return logits

    byte = ByteTokenizer()
    model = Scripted([104, 105, 7, 33])
    model.stop_ids = {byte.eos_id} | _end_ids(None)
    assert greedy(model, byte, "q", max_new_tokens=4) == "hi\x07!"  # 7 ends nothing here
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [byte.eos_id, 7]}))
    model = Scripted([104, 105, 7, 33])
    model.stop_ids = {byte.eos_id} | _end_ids(tmp_path / "generation_config.json")
    assert greedy(model, byte, "q", max_new_tokens=4) == "hi"

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    model = Scripted(byte.encode("4<|im_end|>\n<|im_start|>user"))
    assert greedy(model, byte, chat, max_new_tokens=30) == "4"  # the plain ChatML turn's end
    assert model.seen[0] == byte.encode(plain_chat(chat, add_generation_prompt=True))
    with pytest.raises(UsageError, match="the prompt must be a text or a list of messages"):
        greedy(model, byte, [{"role": "user"}])

    llama = bos_tokenizer(tmp_path)
    model = Scripted([llama.eos_id], vocab_size=llama.vocab_size)
    greedy(model, llama, "<|begin_of_text|>the cat")
    assert model.seen[0] == llama.encode_as_transformers("the cat")  # one BOS, not two
    model = Scripted([llama.eos_id], vocab_size=llama.vocab_size)
    greedy(model, llama, "the cat", add_special_tokens=False)
    assert model.seen[0] == llama.encode("the cat")

    padded, imported = Scripted([300, 300]), Scripted([300, 300], vocab_size=320, vocab_multiple_of=1)
    greedy(padded, byte, "q", max_new_tokens=2)
    greedy(imported, byte, "q", max_new_tokens=2)
    assert padded.seen[1][-1] < byte.vocab_size and imported.seen[1][-1] == 300
