"""The lm-evaluation-harness side of `--eval-tasks`: loading tasks, and the live model behind lm-eval's `LM`.

Imported only once `need_lm_eval()` has passed (lm_eval is the optional extra `zerotrain[eval]`).

    load_tasks(specs) -> Tasks        at start-up, on every rank, before anything trains: each task name is
                                      looked up in lm-eval's registry (our shipped tasks first), each YAML
                                      file or folder loaded as lm-eval loads it; its data is read now, so a
                                      task that cannot load (a download without network, a bad file) is
                                      refused here in one line, never at step 10,000
    LiveLM(engine, tokenizer, ...)    lm-eval's TemplateLM over the live engine: lm-eval tokenizes as its HF
                                      model does (TemplateLM._encode_pair), we score (components/tasks)
    score(tasks, lm, limit)           lm_eval.evaluator.evaluate on every rank: the same requests, the same
                                      all-reduced log-likelihoods, so the same metrics everywhere

A task's `data_files` are read relative to its YAML's folder (lm-eval reads them relative to the working
directory; we change into the folder while the task loads, so a task ships with its data, as ours in
zerotrain/recipes/eval_tasks/ do).
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from lm_eval import evaluator
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.task import Task
from lm_eval.models.utils import has_bos_prefix
from lm_eval.tasks import TaskManager, get_task_dict

from zerotrain import resource_dir
from zerotrain.dataio.format.errors import first_line
from zerotrain.launcher.components.tasks import (GENERATION, batch_rows, flat_results, longest_first, pass_widths,
                                                 request_row, score_rows, shard)
from zerotrain.launcher.errors import UsageError

SHIPPED = resource_dir("zerotrain.recipes", "eval_tasks")
FETCH_HINT = ("fetch its data once where there is network (it is then read from the Hugging Face datasets cache),"
              " or give a task YAML with dataset_path: json and local data_files")


@dataclass
class Tasks:
    """The loaded tasks: lm-eval's task dict, and per task its metrics' higher_is_better."""
    task_dict: dict
    higher: dict[str, dict[str, bool]]

    @property
    def names(self) -> list[str]:
        return sorted(self.higher)


def _task_objects(node) -> list[Task]:
    """Every Task in lm-eval's (possibly nested: groups) task dict."""
    if isinstance(node, Task):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _task_objects(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _task_objects(v)]
    return []


@functools.lru_cache(maxsize=4)
def _manager(include: tuple[str, ...], defaults: bool) -> TaskManager:
    """lm-eval's task index over `include` (and its own ~10k task YAMLs when `defaults`: 15-20 s on a CPU core,
    so built once per process)."""
    return TaskManager(include_path=list(include), include_defaults=defaults)


def load_tasks(specs: list[str]) -> Tasks:
    """Every spec (a task name, a YAML file or a folder of them) loaded with its data; UsageError (one line
    naming the task) for one that cannot be, or that generates text."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # lm-eval says a line per task at INFO, on every rank
    folders = [Path(s) for s in specs if Path(s).is_dir()]
    include = [str(SHIPPED), *map(str, folders)]
    manager = _manager(tuple(include), False)
    items = []  # (spec, what lm-eval loads, the folder to load it from)
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            yamls = sorted(path.rglob("*.yaml"))
            if not yamls:
                raise UsageError(f"--eval-tasks {spec}: no task YAML in this folder")
            items += [(spec, str(y.resolve()), y.parent) for y in yamls]
        elif path.is_file():
            items.append((spec, str(path.resolve()), path.resolve().parent))
        elif path.suffix in (".yaml", ".yml") or "/" in spec:
            raise UsageError(f"--eval-tasks {spec}: no such file or folder")
        else:
            items.append((spec, spec, None))
    if any(folder is None and spec not in manager.all_tasks for spec, _, folder in items):
        manager = _manager(tuple(include), True)  # lm-eval's own tasks too
    task_dict = {}
    for spec, item, folder in items:
        if folder is None:
            entry = manager.task_index.get(spec)
            if entry is None:
                close = difflib.get_close_matches(spec, manager.all_tasks, n=3)
                raise UsageError(f"--eval-tasks {spec}: not a task lm-evaluation-harness knows"
                                 + (f" (close: {', '.join(close)})" if close else " (a name, a task YAML or a folder)"))
            folder = Path(entry.yaml_path).parent if getattr(entry, "yaml_path", None) else Path.cwd()
        try:
            with contextlib.chdir(folder):
                task_dict.update(get_task_dict([item], manager))
        except UsageError:
            raise
        except Exception as e:  # lm-eval and datasets raise many kinds; each is one line here
            why = first_line(e)
            hint = f"; {FETCH_HINT}" if _looks_offline(e) else ""
            raise UsageError(f"--eval-tasks {spec}: cannot load the task ({type(e).__name__}: {why}){hint}") from None
    higher = {}
    for task in _task_objects(task_dict):
        name = task.config.task
        if task.OUTPUT_TYPE == GENERATION:
            raise UsageError(f"--eval-tasks {name}: a generation task (output_type generate_until) is not scored"
                             " in the loop; export the model and run lm_eval on it")
        higher[name] = {k: bool(v) for k, v in task.higher_is_better().items()}
    return Tasks(task_dict, higher)


def _looks_offline(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("offline", "connection", "couldn't reach", "not found on the hub", "hub",
                                   "doesn't exist", "max retries", "resolve"))


class LiveLM(TemplateLM):
    """The live model (a DeepSpeed engine, or a module) as lm-eval's LM. To lm-eval it is one process (rank 0
    of 1): every rank runs lm-eval alike, and the sharding over ranks happens inside `_loglikelihood_tokens`."""

    def __init__(self, model, tokenizer, *, max_length: int, micro_batch: int, dp_rank: int = 0, dp_world: int = 1,
                 sequence_parallel: int = 1, device=None, quiet: bool = False):
        """quiet: this process prints nothing while it scores (every rank but rank 0: lm-eval's progress bars and
        log lines would repeat once per rank)."""
        super().__init__()
        self.model, self.tok, self.quiet = model, tokenizer, quiet
        self.max_length, self.micro_batch = max_length, micro_batch
        self.dp_rank, self.dp_world, self.sp = dp_rank, dp_world, sequence_parallel
        self.on = device if device is not None else next(getattr(model, "module", model).parameters()).device
        self.forwards = 0  # forward passes run (the same on every rank: tests read it)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        # HFLM's: BOS when the tokenizer has one, else EOS (what an empty context is scored after)
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # HFLM's (add_bos_token left unset): tokenizer.encode(string) with the tokenizer's own special tokens (a
        # BOS where its post-processor adds one), but none for a string that already starts with the prefix token
        if add_special_tokens is None and has_bos_prefix(string, self.tok.special_text(self.prefix_token_id)):
            add_special_tokens = False
        return self.tok.encode_as_transformers(string) if add_special_tokens is not False else self.tok.encode(string)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)  # no bar per rank

    def _rows(self, requests) -> tuple[list[list[int]], list[int]]:
        """lm-eval's (cache key, context tokens, continuation tokens) requests as rows and continuation lengths."""
        pairs = [request_row(context, continuation, self.max_length) for _, context, continuation in requests]
        return [row for row, _ in pairs], [n for _, n in pairs]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows, conts = self._rows(requests)
        n, lengths = len(rows), [len(r) for r in rows]
        order = longest_first(lengths)  # alike lengths share a batch
        mine = shard(n, self.dp_rank, self.dp_world, self.micro_batch, order)
        widths = pass_widths(lengths, order, self.dp_world, self.micro_batch, self.sp)  # alike on every rank
        table = torch.zeros(n, 2, dtype=torch.float64)
        module = getattr(self.model, "module", self.model)
        for batch, width in zip(mine.batches, widths):
            ids = batch_rows([rows[i] for i in batch], self.sp, self.tok.eos_id, width)
            logits = self._forward(ids)
            sp = getattr(module, "sequence_parallel", None)
            positions = sp.local(ids.shape[1]) if sp is not None else slice(0, ids.shape[1])
            table[batch] += score_rows(logits.cpu(), [rows[i] for i in batch], [conts[i] for i in batch], positions)
        for width in widths[len(mine.batches):]:  # only so that this rank joins the others' gathers (ZeRO-3)
            self._forward(torch.full((1, width), self.tok.eos_id, dtype=torch.long))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            summed = table.to(self.on)
            dist.all_reduce(summed)  # disjoint requests (data-parallel) and positions (sequence-parallel) add up
            table = summed.cpu()
        return [(float(ll), bool(missed == 0)) for ll, missed in table.tolist()]

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        ids = ids.to(self.on)
        positions = torch.arange(ids.shape[1], device=self.on).expand_as(ids)
        return self.model(input_ids=ids, position_ids=positions)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # HFLM's windows (lm_eval.models.huggingface), scored in one call so every rank runs alike
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        sums = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            sums[i] += ll
        return sums

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("generation tasks are refused at start-up (components/tasks/lm.py load_tasks)")


class _Counter(LiveLM):
    """LiveLM without a model: lm-eval builds and tokenizes every request as for a scoring, and the rows' lengths
    are kept instead of scored (the planner's cost of a scoring: planning/evaluation.py)."""

    def __init__(self, tokenizer, max_length: int):
        super().__init__(None, tokenizer, max_length=max_length, micro_batch=1, device=torch.device("cpu"))
        self.lengths: list[int] = []

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        self.lengths += [len(row) for row in self._rows(requests)[0]]
        return [(0.0, False)] * len(requests)


def row_lengths(tasks: Tasks, tokenizer, max_length: int, limit: int | None) -> list[int]:
    """The length of every row one scoring runs (context + continuation, cut to the model's length; rolling
    tasks: one per window), from lm-eval's own request building, without a forward."""
    counter = _Counter(tokenizer, max_length)
    with contextlib.redirect_stderr(io.StringIO()):  # lm-eval's progress bars: a scoring says them, not the plan
        evaluator.evaluate(counter, tasks.task_dict, limit=limit, bootstrap_iters=0, log_samples=False)
    return counter.lengths


def score(tasks: Tasks, lm: LiveLM, limit: int | None) -> tuple[dict, dict]:
    """All ranks call this together. Returns ({task: {metric: value}}, {task: per-example records}), the same
    on every rank. The model is in eval mode under no_grad, and back in its mode after."""
    module = getattr(lm.model, "module", lm.model)
    was_training = module.training
    lm.model.eval()
    try:
        with torch.no_grad(), _silenced(lm.quiet):
            out = evaluator.evaluate(lm, tasks.task_dict, limit=limit, bootstrap_iters=0, log_samples=True)
    finally:
        lm.model.train(was_training)
    metrics = flat_results(out["results"])
    samples = {task: [{"doc_id": s["doc_id"], "target": str(s.get("target")),
                       "loglikelihoods": _loglikelihoods(s.get("filtered_resps")),
                       **{k: float(s[k]) for k in metrics.get(task, {}) if isinstance(s.get(k), (int, float))}}
                      for s in rows] for task, rows in out.get("samples", {}).items()}
    return metrics, samples


@contextlib.contextmanager
def _silenced(quiet: bool):
    """Nothing printed while lm-eval runs, when `quiet`: its progress bars (tqdm on sys.stderr) and its "lm_eval"
    logger's lines (a handler of its own, holding the stream it was made with: raised to ERROR instead)."""
    if not quiet:
        yield
        return
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _loglikelihoods(resps) -> list[float]:
    """A sample's filtered responses as plain floats: (ll, is_greedy) pairs for log-likelihood requests,
    one float for a rolling one."""
    out = []
    for r in resps or []:
        if isinstance(r, (list, tuple)) and r:
            r = r[0]
        try:
            out.append(float(r))
        except (TypeError, ValueError):
            pass
    return out
