"""F1 score, as an `evaluate` metric module shipped with the project (loads offline by path).

average: "binary" (F1 of pos_label), "macro" (mean over labels), "micro" (= accuracy
for single-label classification) or "weighted" (mean weighted by label support)."""

import datasets
import evaluate
import numpy as np


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Harmonic mean of precision and recall.",
            citation="",
            inputs_description="predictions and references: lists of integer labels",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, average="binary", pos_label=1):
        predictions, references = np.asarray(predictions), np.asarray(references)
        labels = np.union1d(predictions, references)

        def f1_of(label):
            true_positive = np.sum((predictions == label) & (references == label))
            predicted, actual = np.sum(predictions == label), np.sum(references == label)
            return 2 * true_positive / (predicted + actual) if predicted + actual else 0.0

        if average == "binary":
            return {"f1": float(f1_of(pos_label))}
        if average == "micro":
            return {"f1": float(np.mean(predictions == references)) if len(references) else 0.0}
        scores = np.array([f1_of(label) for label in labels])
        if average == "macro":
            return {"f1": float(scores.mean()) if len(scores) else 0.0}
        if average == "weighted":
            support = np.array([np.sum(references == label) for label in labels])
            return {"f1": float((scores * support).sum() / support.sum()) if support.sum() else 0.0}
        raise ValueError(f"average must be binary, micro, macro or weighted, got {average!r}")
