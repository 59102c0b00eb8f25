"""Accuracy of blended prefill on a task a pretrained model solves: finding a fact among documents.

Model: SmolLM2-135M-Instruct (``tests/realmodel.py``), cast to ``--dtype``. Text: the held-out
filler of ``tests/realmodel.py`` (this project's own sources and docs, newer than the model).

Prompt: a start token (the tokenizer's BOS, computed, never stored), then ``D`` documents of
``--doc-tokens`` each (a multiple of 256, so that every token of a document is in a stored chunk),
then a question. A document is a window of filler lines with one fact sentence inserted at a line
start, "The <kind> of project <Name> is <4-digit number>.": one document's fact is of the asked
kind, "The access code of project Falcon is 4829.", every other one of another kind ("The room
number of project Orion is 5513.", ...); names, kinds and numbers drawn from a seeded RNG, all
distinct within a prompt. Each document is prefilled alone and stored (``BlendEngine.precompute``);
every prompt has its own cache salt, so it finds its own documents only. Tasks (``--tasks``):

- ``recall``: the access code sits in document ``i % D`` of prompt ``i``; the question: "Question:
  what is the access code of project Falcon? Answer: The access code of project Falcon is". It has
  to find the one access code among ``D`` facts, wherever it sits.
- ``split``: the access code is cut by a document boundary: document ``k`` ends with "The access
  code of project Falcon is", document ``k + 1`` begins with " 4829." (``k = i % (D - 1)``; every
  document holds a fact of another kind as well). The code's KV says whose code it is only
  through attention across the two documents, which each document alone lacks: what blending has
  to restore (and what epic's first rows of a chunk cover by construction).

(With facts of the same kind in the other documents, a 135M model finds the right one only about
half the time with full prefill at 8 documents: too weak a baseline to measure blending against.)

Scoring: exact match of greedy decoding. The prompt and the answer's tokens (" 4829") are prefilled
together in each mode (they are in no stored chunk, so every mode computes them); the answer is
right when the argmax after the prompt and after each answer token is the next answer token and the
argmax after the last digit is not a digit: when greedy decoding would write " 4829" and then no
further digit (up to rounding: the answer's rows are computed together rather than one at a time).
One prefill per mode instead of one per decoded token; ``--decode`` also decodes greedily
(``BlendEngine.generate``) and counts the prompts where the two disagree.

Modes: full, naive, the engine's default (``engine.blend.DEFAULT``), cacheblend at each
``--ratios``, cacheblend 15 % checked at layer 2 and with gradual filtering, random selection at
15 %, epic(16), naive with the first row of every stored document recomputed. Per mode: accuracy
with its 95 % Wilson interval over the prompts; ``recomputed``: the share of the stored tokens the
last layer recomputed; ``compute``: the rows computed over all layers, as a share of full prefill's.
A markdown table per task and document count; ``--json PATH`` writes the results, with each
prompt's outcome per mode and the document its fact sits in (for paired comparisons).

Usage::

    python benchmarks/blend_task.py --device cuda --dtype bf16 --prompts 100 --docs 4,8
    python benchmarks/blend_task.py --device cpu --prompts 10 --docs 4 --tasks recall  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from blend_ttft import served  # noqa: E402
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.engine.blend import (DEFAULT, FULL, NAIVE, BlendEngine, Mode, Prefill,  # noqa: E402
                                  cacheblend, epic, random_blend)
from tests import realmodel  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TASKS = ("recall", "split")
NAMES = ("Falcon Orion Cobalt Juniper Maple Granite Harbor Willow Summit Ember Aspen Beacon Cedar "
         "Glacier Hazel Indigo Jasper Lotus Meadow Nova Onyx Pioneer Quartz Raven Sierra Tundra "
         "Violet Zephyr Comet Lantern Marble Nebula Osprey Pebble Saffron Thistle Walnut Yarrow "
         "Badger Canyon Dolphin Fern Heron Iris Kestrel Lynx Mistral Otter Prairie Sparrow").split()
ASKED_RELATION = "access code"
OTHER_RELATIONS = ("room number", "ticket number", "order number", "phone extension",
                   "badge number", "invoice number")
MARGIN = 16  # tokens of filler kept before and after an inserted fact


@dataclass
class Filler:
    """The held-out text's token ids and the indexes of its tokens that end a line."""

    ids: np.ndarray
    line_ends: np.ndarray
    newline: np.ndarray  # bool over the vocabulary: the token ends a line


@dataclass
class Item:
    """One prompt: its documents (stored), its question (computed) and the expected code."""

    docs: list[np.ndarray]
    question: np.ndarray
    code: str
    target: int  # the document holding the asked fact (split: its first half)


def load_filler(tokenizer: Any) -> Filler:
    ids = realmodel.heldout_tokens(tokenizer)
    newline = np.zeros(len(tokenizer), bool)
    for tid in np.unique(ids):
        newline[tid] = tokenizer.decode([int(tid)]).endswith("\n")
    return Filler(ids, np.flatnonzero(newline[ids]), newline)


def encode(tokenizer: Any, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False).input_ids, np.int64)


def document(rng: np.random.Generator, filler: Filler, n: int, fact: np.ndarray) -> np.ndarray:
    """``n`` tokens of filler lines from a random line start, ``fact`` inserted at a line start
    with at least ``MARGIN`` filler tokens either side."""
    start = int(filler.line_ends[rng.integers(0, len(filler.line_ends) - 1)]) + 1
    start = min(start, len(filler.ids) - n)
    text = filler.ids[start:start + n - len(fact)]
    at = np.flatnonzero(filler.newline[text[MARGIN - 1:len(text) - MARGIN]]) + MARGIN
    cut = int(rng.choice(at)) if len(at) else len(text) // 2
    return np.concatenate([text[:cut], fact, text[cut:]])


def make_item(rng: np.random.Generator, filler: Filler, tokenizer: Any, task: str, n_docs: int,
              doc_tokens: int, index: int) -> Item:
    """Prompt ``index`` of ``task`` (module docstring): ``n_docs`` documents and a question."""
    names = [str(x) for x in rng.choice(NAMES, n_docs + 1, replace=False)]
    codes = [str(x) for x in rng.choice(np.arange(1000, 10000), n_docs + 1, replace=False)]
    relations = [OTHER_RELATIONS[j % len(OTHER_RELATIONS)]
                 for j in rng.permutation(n_docs + 1)]  # every other fact of another kind
    if task == "recall":
        k = ask = index % n_docs
    else:  # the asked fact (the extra name) across documents k and k + 1
        k, ask = index % (n_docs - 1), n_docs
    relations[ask] = ASKED_RELATION
    facts = [encode(tokenizer, f"\nThe {r} of project {a} is {c}.\n")
             for r, a, c in zip(relations, names, codes)]
    if task == "recall":
        docs = [document(rng, filler, doc_tokens, f) for f in facts[:n_docs]]
    else:
        head = encode(tokenizer, f"\nThe {ASKED_RELATION} of project {names[ask]} is")
        tail = encode(tokenizer, f" {codes[ask]}.\n")
        docs = [document(rng, filler, doc_tokens - len(head) * (i == k) - len(tail) * (i == k + 1),
                         facts[i]) for i in range(n_docs)]
        docs[k] = np.concatenate([docs[k], head])
        docs[k + 1] = np.concatenate([tail, docs[k + 1]])
    question = encode(tokenizer, f"\nQuestion: what is the {ASKED_RELATION} of project "
                                 f"{names[ask]}? Answer: The {ASKED_RELATION} of project "
                                 f"{names[ask]} is")
    assert all(len(d) == doc_tokens for d in docs)
    return Item(docs, question, codes[ask], k)


def modes(ratios: list[float], seed: int) -> dict[str, Mode]:
    out: dict[str, Mode] = {"full": FULL, "naive": NAIVE, "default": DEFAULT}
    out.update({f"cacheblend {r:.0%}": cacheblend(r) for r in ratios})
    out["check2 15%"] = cacheblend(0.15, 2)
    out["gradual1 15%"] = cacheblend(0.15, 1, widen=2.0)
    out["random 15%"] = random_blend(0.15, seed=seed)
    out["epic 16"] = epic(16)
    out["naive+sink"] = Mode("naive", sinks=1)
    return out


def forced(engine: BlendEngine, prompt: np.ndarray, answer: np.ndarray, mode: Mode,
           digits: np.ndarray) -> tuple[bool, Prefill]:
    """Whether greedy decoding after ``prompt`` writes ``answer`` and then no digit, from one
    prefill of the prompt and the answer."""
    p = engine.prefill(np.concatenate([prompt, answer]), mode)
    row = {int(x): i for i, x in enumerate(p.positions)}
    at = [row[q] for q in range(len(prompt) - 1, len(prompt) + len(answer))]
    argmax = p.logits[at].argmax(-1).cpu().numpy()
    return bool((argmax[:-1] == answer).all() and not digits[argmax[-1]]), p


def decoded(engine: BlendEngine, tokenizer: Any, prompt: np.ndarray, code: str, n: int,
            mode: Mode) -> bool:
    """Whether ``n`` greedily decoded tokens begin with the code (after spaces) and no further
    digit."""
    text = tokenizer.decode(engine.generate(prompt, mode, max_new_tokens=n)).lstrip()
    return text.startswith(code) and not text[len(code):len(code) + 1].isdigit()


def shares(p: Prefill, layers: int) -> tuple[float, float]:
    """(stored tokens the last layer recomputed, rows computed over all layers / full's)."""
    stored = int(p.hit.sum())
    recomputed = (p.computed[-1] - int((~p.hit).sum())) / stored if stored else 1.0
    return recomputed, sum(p.computed) / (layers * p.length)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of ``k`` successes in ``n``."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def run_setting(engine: BlendEngine, tokenizer: Any, filler: Filler, task: str, n_docs: int,
                args: argparse.Namespace, mode_set: dict[str, Mode]) -> dict[str, Any]:
    """Every mode on ``--prompts`` prompts of ``task`` with ``n_docs`` documents."""
    rng = np.random.default_rng([args.seed, TASKS.index(task), n_docs])
    digits = np.zeros(len(tokenizer), bool)
    for d in "0123456789":
        digits[encode(tokenizer, d)] = True
    bos = np.asarray([tokenizer.bos_token_id], np.int64)
    outcomes: dict[str, list[int]] = {m: [] for m in mode_set}
    targets = []
    recomputed: dict[str, list[float]] = {m: [] for m in mode_set}
    compute: dict[str, list[float]] = {m: [] for m in mode_set}
    disagree = short = 0
    t0 = time.monotonic()
    for i in range(args.prompts):
        if i and i % 25 == 0:
            print(f"# {task}, {n_docs} documents: {i} prompts in {time.monotonic() - t0:.0f} s",
                  flush=True)
        item = make_item(rng, filler, tokenizer, task, n_docs, args.doc_tokens, i)
        engine.salt = f"{task}-{n_docs}-{i}"  # each prompt finds its own documents only
        for doc in item.docs:
            assert engine.precompute(doc, prefix=bos if args.bos_prefix else None).ok
        targets.append(item.target)
        prompt = np.concatenate([bos, *item.docs, item.question])
        answer = encode(tokenizer, f" {item.code}")
        for name, mode in mode_set.items():
            ok, p = forced(engine, prompt, answer, mode, digits)
            if mode.kind != "full" and int(p.hit.sum()) < n_docs * args.doc_tokens:
                short += 1
            if args.decode:
                disagree += ok != decoded(engine, tokenizer, prompt, item.code, len(answer) + 1,
                                          mode)
            outcomes[name].append(int(ok))
            a, b = shares(p, engine.layers)
            recomputed[name].append(a)
            compute[name].append(b)
    n = args.prompts
    result = {"task": task, "docs": n_docs, "tokens": 1 + n_docs * args.doc_tokens,
              "prompts": n, "seconds": round(time.monotonic() - t0, 1), "targets": targets,
              "modes": {}}
    for name, hits in outcomes.items():
        lo, hi = wilson(sum(hits), n)
        result["modes"][name] = {"correct": sum(hits), "accuracy": sum(hits) / n, "ci95": [lo, hi],
                                 "recomputed": float(np.mean(recomputed[name])),
                                 "compute": float(np.mean(compute[name])), "outcomes": hits}
    if args.decode:
        result["forced_vs_decoded_disagreements"] = disagree
    if short:
        result["prefills_missing_stored_chunks"] = short
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"\n### {result['task']}: {result['docs']} documents (~{result['tokens']} tokens), "
             f"{result['prompts']} prompts, {result['seconds']:.0f} s",
             "",
             "| mode | accuracy | 95 % CI | recomputed | compute |",
             "|---|---:|---:|---:|---:|"]
    for name, m in result["modes"].items():
        lo, hi = m["ci95"]
        lines.append(f"| {name} | {m['accuracy']:.1%} ({m['correct']}/{result['prompts']}) | "
                     f"[{lo:.1%}, {hi:.1%}] | {m['recomputed']:.1%} | {m['compute']:.1%} |")
    for key in ("forced_vs_decoded_disagreements", "prefills_missing_stored_chunks"):
        if key in result:
            lines.append(f"\n{key.replace('_', ' ')}: {result[key]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--prompts", type=int, default=100, help="prompts per task and document count")
    p.add_argument("--docs", default="4,8", help="document counts")
    p.add_argument("--doc-tokens", type=int, default=256)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--ratios", default="0.05,0.08,0.15,0.30")
    p.add_argument("--bos-prefix", action="store_true",
                   help="prefill each document behind the start token (not stored)")
    p.add_argument("--decode", action="store_true",
                   help="also decode greedily and count disagreements with the one-prefill score")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args()
    docs = [int(x) for x in args.docs.split(",")]
    tasks = args.tasks.split(",")
    if args.doc_tokens % 256 or args.doc_tokens < 256:
        p.error("--doc-tokens must be a multiple of 256 (a stored chunk)")
    if any(t not in TASKS for t in tasks) or not 2 <= min(docs) <= max(docs) < len(NAMES):
        p.error(f"--tasks among {TASKS}; 2 to {len(NAMES) - 1} documents")
    model, tokenizer = realmodel.load(DTYPES[args.dtype], args.device)
    filler = load_filler(tokenizer)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * \
        DTYPES[args.dtype].itemsize
    storage = int(4 * max(docs) * args.doc_tokens * token_bytes / (1 << 20)) + 256
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"# {device}; SmolLM2-135M-Instruct, {args.dtype}; documents of {args.doc_tokens} tokens"
          f"{' prefilled behind the start token' if args.bos_prefix else ''}; seed {args.seed}",
          flush=True)
    mode_set = modes([float(x) for x in args.ratios.split(",")], args.seed)
    results = []
    prefix = f"kvtask_{os.getpid()}"
    with served(prefix, args.device, storage) as url, BlendClient(url) as client:
        engine = BlendEngine(model, client, "smollm2-135m",
                             num_tokens=1 + max(docs) * args.doc_tokens + 128)
        for task in tasks:
            for n_docs in docs:
                results.append(run_setting(engine, tokenizer, filler, task, n_docs, args,
                                           mode_set))
                print(table(results[-1]), flush=True)
                if args.json:  # after each setting: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"model": "SmolLM2-135M-Instruct", "device": device,
                                   "dtype": args.dtype, "doc_tokens": args.doc_tokens,
                                   "bos_prefix": args.bos_prefix, "seed": args.seed,
                                   "results": results}, f, indent=2)
        engine.close()


if __name__ == "__main__":
    main()
