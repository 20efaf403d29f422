"""Accuracy, as an `evaluate` metric module shipped with the project (loads offline by path)."""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the reference labels.",
            citation="",
            inputs_description="predictions and references: lists of integer labels",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)
        weights = np.ones(len(correct)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        return {"accuracy": float((correct * weights).sum() / weights.sum()) if len(correct) else 0.0}
