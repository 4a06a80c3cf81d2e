"""BATCH_SIZE (images per process) is resolved with the sampler settings that --set gives."""

from __future__ import annotations

from pksampler.train.config.load import load_config


def test_batch_size_is_resolved_with_the_samples_per_class_given_by_set(tmp_path):
    config = load_config(None, ["sampler.samples_per_class=8"], environ={"BATCH_SIZE": "16"})
    assert config.sampler.classes_per_step * config.sampler.samples_per_class == 16
    # 18 is not a multiple of the default K=4, but is of the K=6 that --set gives: valid.
    config = load_config(None, ["sampler.samples_per_class=6"], environ={"BATCH_SIZE": "18"})
    assert (config.sampler.classes_per_step, config.sampler.samples_per_class) == (3, 6)
    # An explicit --set of G wins over BATCH_SIZE (--set has the last word).
    config = load_config(None, ["sampler.classes_per_step=5"], environ={"BATCH_SIZE": "16"})
    assert config.sampler.classes_per_step == 5
