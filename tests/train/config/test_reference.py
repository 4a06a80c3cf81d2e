"""The configuration reference lists the keys of the free-form ``args`` blocks, from the implementations."""

from __future__ import annotations

import inspect

import pksampler.train  # noqa: F401  (registers the choices and the args' implementations)
from pksampler.train.builders import DATA_ARGS, DATA_SOURCES, SAMPLER_ARGS, SAMPLERS
from pksampler.train.config import choices
from pksampler.train.config.reference import argument_docs, argument_rows, render


def test_the_args_keys_people_set_are_in_the_reference():
    text = render()
    for key in ("sampler.args.locality", "sampler.args.window", "data.args.block_cache", "data.args.block_size",
                "data.args.cache_dir"):
        assert f"| `{key}` |" in text, key
    rows = {key: (default, notes) for key, default, notes in argument_rows("sampler")}
    assert rows["sampler.args.window"][0] == "`2048`" and rows["sampler.args.locality"][1].startswith("balanced: ")
    rows = {key: (default, notes) for key, default, notes in argument_rows("data")}
    assert rows["data.args.block_size"][0] == "`'16MiB'`" and rows["data.args.block_cache"][1].startswith("shards: ")
    assert rows["data.args.on_bad"][1].startswith("folder, list, shards: ")


def test_every_source_and_sampler_has_its_arguments_registered_and_the_builder_keys_are_left_out():
    assert set(choices.arguments("data")) == set(DATA_SOURCES) and set(choices.arguments("sampler")) == set(SAMPLERS)
    for target, set_by_builder in [*DATA_ARGS.values(), *SAMPLER_ARGS.values()]:
        assert set(set_by_builder) <= set(inspect.signature(target).parameters), target
    listed = {key.rsplit(".", 1)[1] for key, _, _ in argument_rows("sampler")}
    assert not listed & {"labels", "rank", "num_replicas", "seed", "shard_ids", "classes_per_step"}
    assert choices.arguments("loss") == {}


def test_argument_docs_reads_a_google_args_section():
    def documented(alpha, beta, gamma, delta):
        """Summary.

        Args:
            alpha: first line
                continued here.
            beta, gamma: both at once.

        Returns:
            delta: not an argument.
        """

    assert argument_docs(inspect.getdoc(documented)) == {
        "alpha": "first line continued here.", "beta": "both at once.", "gamma": "both at once."}
    assert argument_docs("No sections at all.") == {}
