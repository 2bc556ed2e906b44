"""MetricSums (issue 20), the one object every evaluation sums its batches with: accuracy, perplexity and
a confusion matrix against explicit computations over all the items, reset, the refusals, and a
2-process gloo all-reduce against one process over the same batches."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neutreno.evaluation.classification import classification_sums, summarize_classification
from neutreno.evaluation.metric import MetricSums
from neutreno.evaluation.segmentation import confusion_matrix
from neutreno.training.language_model import summarize_language_model

K = 7  # classes


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five batches of uneven sizes (logits (B, K), labels (B,)), the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, K, generator=generator), torch.randint(0, K, (size,), generator=generator))
        for size in (16, 9, 16, 1, 5)
    ]


def test_tied_logits_rank_by_class_index_as_argmax_does():
    """Top-1 came from ``topk``, whose order among tied logits is unspecified (and not argmax's first
    maximum): all-equal logits over 10 classes scored 'class 8'; McNemar's per-item test, reading
    argmax, then counted other hits than the reported top-1. bf16 logits tie often."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (200, 10), generator=generator).float()  # ties in nearly every row
    labels = torch.randint(0, 10, (200,), generator=generator)
    sums = classification_sums(logits, labels)
    assert sums["top1"] == (logits.argmax(-1) == labels).sum()
    ranked = [sorted(range(10), key=lambda k: -row[k]) for row in logits.tolist()]  # stable: index order
    assert sums["top5"] == sum(label in r[:5] for r, label in zip(ranked, labels.tolist(), strict=True))
    constant = classification_sums(torch.zeros(10, 10), torch.arange(10))
    assert (constant["top1"], constant["top5"]) == (1, 5)


def test_accuracy_over_batches_equals_the_explicit_count_over_all_images():
    metric = MetricSums(summarize_classification)
    for logits, labels in batches():
        metric.update(classification_sums(logits, labels))
    got = metric.compute()

    top1 = top5 = 0
    loss = 0.0
    rows = [
        pair for logits, labels in batches() for pair in zip(logits.tolist(), labels.tolist(), strict=True)
    ]
    for row, label in rows:
        ranked = sorted(range(K), key=lambda k: -row[k])
        top1 += ranked[0] == label
        top5 += label in ranked[:5]
        loss += math.log(sum(math.exp(v) for v in row)) - row[label]
    assert got["count"] == len(rows) == 47
    assert got["top1"] == pytest.approx(100 * top1 / len(rows), rel=1e-12)
    assert got["top5"] == pytest.approx(100 * top5 / len(rows), rel=1e-12)
    assert got["loss"] == pytest.approx(loss / len(rows), rel=1e-5)  # float32 cross-entropy per batch


def test_top5_of_five_classes_or_fewer_is_not_reported():
    """Scored over 5 classes or fewer (a 3-class subset of a 10-class model's data, a 3-class run),
    every label is among the five best: top-5 came out 100.0 whatever the model, in results.json and
    neutreno eval's output. It is left out there; with 6 classes it is the explicit count."""
    generator = torch.Generator().manual_seed(3)
    for classes in (2, 3, 5, 6):
        metric = MetricSums(summarize_classification)
        logits, labels = torch.randn(40, classes, generator=generator), torch.randint(0, classes, (40,))
        metric.update(classification_sums(logits, labels))
        got = metric.compute()
        assert got["top1"] == pytest.approx(100 * (logits.argmax(-1) == labels).float().mean().item())
        if classes <= 5:
            assert "top5" not in got
        else:
            worst = logits.gather(1, labels[:, None]).squeeze(1) == logits.min(-1).values  # ranked 6th of 6
            assert got["top5"] == pytest.approx(100 * (1 - worst.float().mean().item()))


def test_perplexity_over_batches_equals_exp_of_the_mean_nll_of_all_tokens():
    generator = torch.Generator().manual_seed(1)
    nlls = [torch.rand(size, generator=generator, dtype=torch.float64) * 6 for size in (128, 77, 3)]
    metric = MetricSums(summarize_language_model)
    for nll in nlls:
        metric.update({"nll": nll.sum(), "count": torch.tensor(nll.numel())})
    every = [v for nll in nlls for v in nll.tolist()]
    got = metric.compute()
    assert got["count"] == len(every)
    assert got["ppl"] == pytest.approx(math.exp(sum(every) / len(every)), rel=1e-12)


def test_confusion_matrices_sum_to_the_matrix_of_all_pixels_as_a_cpu_float64_tensor():
    generator = torch.Generator().manual_seed(2)
    pairs = [[torch.randint(0, 4, (5, 6), generator=generator) for _ in "pt"] for _ in range(3)]
    metric = MetricSums()
    for pred, target in pairs:
        metric.update({"confusion": confusion_matrix(pred, target, 4)})
    whole = confusion_matrix(torch.cat([p for p, _ in pairs]), torch.cat([t for _, t in pairs]), 4)
    got = metric.compute()["confusion"]
    assert got.dtype == torch.float64 and got.device.type == "cpu"
    assert torch.equal(got, whole.double())


def test_summaries_of_nothing_scored_are_errors_not_scores():
    """Zero items gave top-1 0 at loss 0, and zero tokens perplexity 1: a perfect language model."""
    with pytest.raises(ValueError, match="no items were scored"):
        summarize_classification({"top1": 0.0, "top5": 0.0, "loss": 0.0, "count": 0.0})
    with pytest.raises(ValueError, match="no tokens were scored"):
        summarize_language_model({"nll": 0.0, "count": 0.0})
    assert summarize_language_model({"nll": 2.0, "count": 2.0})["ppl"] == pytest.approx(math.e)


def test_reset_forgets_every_batch_and_compute_leaves_the_sums_as_they_were():
    metric = MetricSums(summarize_classification)
    for logits, labels in batches()[:2]:
        metric.update(classification_sums(logits, labels))
    metric.reset()
    with pytest.raises(ValueError, match="nothing to compute"):
        metric.compute()
    fresh = MetricSums(summarize_classification)
    for i, (logits, labels) in enumerate(batches()):
        metric.update(classification_sums(logits, labels))
        fresh.update(classification_sums(logits, labels))
        if i == 1:
            assert metric.compute() == metric.compute()  # computing does not add the sums again
    assert metric.compute() == fresh.compute() and metric.batches == 5


def test_the_callers_tensors_are_never_changed():
    first = torch.tensor(1.0, dtype=torch.float64)
    metric = MetricSums()
    metric.update({"x": first})
    metric.update({"x": torch.tensor(2.0)})
    assert first.item() == 1.0 and metric.compute() == {"x": 3.0}


def test_a_snapshot_and_a_loaded_state_are_copies_not_the_running_sums():
    """state_dict of CPU sums returned the sums themselves: a snapshot grew with later batches, and a
    second MetricSums loaded from it added into the first one's totals."""
    first = MetricSums()
    first.update({"hits": torch.tensor(3.0), "count": torch.tensor(4.0)})
    snapshot = first.state_dict()
    first.update({"hits": torch.tensor(1.0), "count": torch.tensor(4.0)})
    assert {k: v.item() for k, v in snapshot["sums"].items()} == {"hits": 3.0, "count": 4.0}
    second = MetricSums()
    second.load_state_dict(snapshot)
    second.update({"hits": torch.tensor(0.0), "count": torch.tensor(100.0)})
    assert first.compute() == {"hits": 4.0, "count": 8.0}
    assert second.compute() == {"hits": 3.0, "count": 104.0}


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (torch.softmax(torch.randn(4, K), 1), "integer class ids (B,)"),  # mixup's soft targets
        (torch.tensor([1, 2, -100, 0]), "class ids must be in [0, 7)"),  # an ignore label
        (torch.tensor([1, 2, 7, 0]), "got 0..7"),
        (torch.tensor([1, 2]), "integer class ids (B,)"),
    ],
)
def test_classification_sums_refuses_what_is_not_one_class_id_per_row(labels, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        classification_sums(torch.randn(4, K), labels)


def test_a_batch_with_other_keys_or_shapes_is_refused_naming_the_key():
    metric = MetricSums()
    metric.update({"top1": torch.tensor(3), "count": torch.tensor(4)})
    with pytest.raises(ValueError, match="batch 2 lacks the sum 'top1'"):
        metric.update({"count": torch.tensor(4)})
    with pytest.raises(ValueError, match="batch 2 adds the sum 'top5'"):
        metric.update({"top1": 1, "top5": 2, "count": 4})
    with pytest.raises(ValueError, match="'top1' the shape \\(2,\\)"):
        metric.update({"top1": torch.tensor([1, 2]), "count": torch.tensor(4)})
    with pytest.raises(ValueError, match="no sums"):
        metric.update({})
    assert metric.compute() == {"top1": 3.0, "count": 4.0}  # the refused batches added nothing
    with pytest.raises(ValueError, match="nothing to compute"):
        MetricSums().compute()


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_metric_sums import batches
from neutreno.evaluation.classification import classification_sums, summarize_classification
from neutreno.evaluation.metric import MetricSums
from neutreno.evaluation.segmentation import confusion_matrix
from neutreno.training.distributed import cleanup_distributed, setup_distributed

context = setup_distributed("cpu")
scores = MetricSums(summarize_classification, context=context)
confusion = MetricSums(context=context)
for i, (logits, labels) in enumerate(batches()):
    if i % context.world_size == context.rank:  # rank 0: batches 0, 2, 4; rank 1: 1, 3
        scores.update(classification_sums(logits, labels))
        confusion.update({{"confusion": confusion_matrix(logits.argmax(-1), labels, {k})}})
result = {{"scores": scores.compute(), "confusion": confusion.compute()["confusion"].tolist()}}
if context.is_main:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
cleanup_distributed(synchronize=True)
"""


def test_two_gloo_processes_sum_to_what_one_process_gets_over_all_batches(tmp_path):
    script = tmp_path / "sums.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), k=K))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, str(script), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "out.json").read_text())

    scores, confusion = MetricSums(summarize_classification), MetricSums()
    for logits, labels in batches():
        scores.update(classification_sums(logits, labels))
        confusion.update({"confusion": confusion_matrix(logits.argmax(-1), labels, K)})
    one = scores.compute()
    assert {k: two["scores"][k] for k in ("top1", "top5", "count")} == {
        k: one[k] for k in ("top1", "top5", "count")
    }
    assert two["scores"]["loss"] == pytest.approx(one["loss"], rel=1e-12)
    assert two["confusion"] == confusion.compute()["confusion"].tolist()


UNEVEN_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_metric_sums import batches
from neutreno.evaluation.classification import classification_sums, summarize_classification
from neutreno.evaluation.metric import MetricSums
from neutreno.training.distributed import cleanup_distributed, setup_distributed

context = setup_distributed("cpu")
result = {{}}
scores = MetricSums(summarize_classification, context=context)
for i, (logits, labels) in enumerate(batches()):
    if context.rank == 0:  # rank 1 gets no batch, as a split smaller than the group leaves one
        scores.update(classification_sums(logits, labels))
result["uneven"] = scores.compute()
keys = {{"a" if context.rank == 0 else "b": 1.0}}
shapes = {{"a": torch.ones(context.rank + 1)}}  # (1,) and (2,)
for name, sums in (("keys", keys), ("shapes", shapes)):
    other = MetricSums(context=context)
    other.update(sums)
    try:
        other.compute()
    except ValueError as error:
        result[name] = str(error)
empty = MetricSums(context=context)
try:
    empty.compute()
except ValueError as error:
    result["empty"] = str(error)
with open(sys.argv[1] + str(context.rank), "w") as f:
    json.dump(result, f)
cleanup_distributed(synchronize=True)
"""


def test_processes_with_no_batch_or_other_sums_agree_instead_of_hanging(tmp_path):
    """A process that added no batch raised alone while the others waited in the all-reduce (a hang
    until the backend's timeout); one that summed other keys of the same total size was added to
    unrelated numbers. Now: zeros where no batch was added, and an error on every process alike."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_SCRIPT.format(tests=str(Path(__file__).parent)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, str(script), str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out{rank}").read_text()) for rank in (0, 1)]
    scores = MetricSums(summarize_classification)
    for logits, labels in batches():
        scores.update(classification_sums(logits, labels))
    one = scores.compute()
    for got in ranks:
        assert got["uneven"]["count"] == one["count"] and got["uneven"]["top1"] == one["top1"]
        assert got["keys"] == "process 1 summed b [], process 0 a []: every process must give the same sums"
        assert (
            got["shapes"] == "process 1 summed a [2], process 0 a [1]: every process must give the same sums"
        )
        assert got["empty"] == "nothing to compute: no batch was added on any process"


def test_plain_numbers_are_summed_in_float64():
    """2²⁴ + 1 is not a float32: a Python number must not pass through float32 on its way in."""
    metric = MetricSums()
    metric.update({"nll": 16777217.0, "count": 3})
    metric.update({"nll": 1.0, "count": 2})
    assert metric.compute() == {"nll": 16777218.0, "count": 5.0}


def test_non_finite_totals_are_refused_not_summarized():
    """A top-1 from NaN logits counts hits like any other (the argmax of NaN is a class): the NaN loss
    beside it is the only sign, and a score was reported from it."""
    from neutreno.evaluation.metric import NonFiniteOutputs

    metric = MetricSums(summarize_classification)
    metric.update(classification_sums(torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.tensor([1, 0])))
    metric.update(classification_sums(torch.full((2, 2), math.nan), torch.tensor([1, 0])))
    with pytest.raises(NonFiniteOutputs, match="'loss' is not finite"):
        metric.compute()
    counts = MetricSums()
    counts.update({"confusion": torch.full((2, 2), math.inf)})
    with pytest.raises(NonFiniteOutputs, match="'confusion'"):
        counts.compute()
