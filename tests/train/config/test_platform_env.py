"""The platform's DATASETS list: parsed into data.datasets, bad entries named in one line, kept by a resume."""

from __future__ import annotations

import pytest

from pksampler.train.config.agreement import check_resume_compatible
from pksampler.train.config.load import ConfigError, load_config, saved_config


def test_several_names_are_the_union_under_datasets_path():
    config = load_config(None, environ={"DATASETS_PATH": "/mnt/data", "DATASETS": "photos, products:shards,a/b"})
    assert config.data.root == "/mnt/data"
    assert config.data.datasets == ("photos", "products:shards", "a/b")
    assert config.to_dict()["data"]["datasets"] == ["photos", "products:shards", "a/b"]


def test_one_name_is_the_data_root_as_before():
    config = load_config(None, environ={"DATASETS_PATH": "/mnt/data", "DATASETS": "photos"})
    assert config.data.root == "/mnt/data/photos" and config.data.datasets == ()
    remote = load_config(None, environ={"DATASETS_PATH": "s3://bucket/sets/", "DATASETS": "photos"})
    assert remote.data.root == "s3://bucket/sets/photos"


@pytest.mark.parametrize("names, message", [
    ("a,,b", r"DATASETS='a,,b': entry 2 is empty \(''\)"),
    ("a,", r"DATASETS='a,': entry 2 is empty"),
    ("a,../x", r"DATASETS='a,../x': entry 2 '../x' leaves the datasets' root"),
    ("a,/etc", r"entry 2 '/etc' leaves the datasets' root"),
    ("a,b/../../c", r"entry 2 'b/../../c' leaves the datasets' root"),
    ("a,b,./a", r"entry 3 './a' repeats entry 1"),
    ("a,a/", r"entry 2 'a/' repeats entry 1"),
    ("a:zip,b", r"entry 1 'a:zip' names the layout 'zip'; after a colon give one of \['folder', 'list', 'shards'\]"),
    # one name obeys the rule for several: '../x' alone would otherwise train on a sibling of the mount
    ("../x", r"DATASETS='../x': entry 1 '../x' leaves the datasets' root"),
    ("/etc", r"DATASETS='/etc': entry 1 '/etc' leaves the datasets' root"),
    ("a/../../x", r"entry 1 'a/../../x' leaves the datasets' root"),
    (" ", r"DATASETS=' ': entry 1 is empty"),
])
def test_bad_entries_are_one_line_naming_the_entry(names, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(None, environ={"DATASETS_PATH": "/mnt/data", "DATASETS": names})
    assert "\n" not in str(caught.value) and "environment variable DATASETS=" in str(caught.value)


def test_the_same_rules_guard_the_config_key():
    with pytest.raises(ConfigError, match=r"data.datasets: entry 2 'x/..' leaves"):
        load_config(None, ["data.datasets=[a, x/..]"])
    with pytest.raises(ConfigError, match=r"data.datasets\[0\]: expected a string, got 3"):
        load_config(None, ["data.datasets=[3]"])


def test_a_resume_keeps_the_dataset_list():
    """The checkpoint's config names the datasets; another list is one line naming both; a checkpoint from before
    the key existed trained one dataset, so it resumes with none listed."""
    environ = {"DATASETS_PATH": "/mnt/data", "DATASETS": "photos,products"}
    saved = load_config(None, environ=environ).to_dict()
    again = load_config(None, environ={**environ, "DATASETS_PATH": "/mnt/moved"})
    check_resume_compatible(saved, again.to_dict(), "last.pt")  # the root may move; the list stays
    other = load_config(None, environ={**environ, "DATASETS": "photos,glyphs"})
    with pytest.raises(ConfigError, match=r"the config changes data.datasets \(data.datasets: \['photos', "
                                          r"'products'\] -> \['photos', 'glyphs'\]\)") as caught:
        check_resume_compatible(saved, other.to_dict(), "last.pt")
    assert "\n" not in str(caught.value)
    older = load_config(None).to_dict()
    del older["data"]["datasets"]
    check_resume_compatible(older, load_config(None).to_dict(), "last.pt")
    assert saved_config(older).data.datasets == ()


def test_one_name_is_read_as_several_are_stripped_and_normalised():
    assert load_config(None, environ={"DATASETS_PATH": "/mnt/data", "DATASETS": " photos/ "}).data.root == \
        "/mnt/data/photos"
    # with no DATASETS_PATH there is no mount to leave: a path of the user's own, as before
    assert load_config(None, environ={"DATASETS": "/srv/photos"}).data.root == "/srv/photos"


def test_several_names_need_datasets_path_and_a_url_is_not_a_name():
    with pytest.raises(ConfigError, match=r"DATASETS='photos,products' lists datasets by name, but DATASETS_PATH "
                                          r"\(the folder or s3:// prefix that holds them\) is not set"):
        load_config(None, environ={"DATASETS": "photos,products"})
    with pytest.raises(ConfigError, match=r"entry 1 's3://bucket/photos' is a URL, not a name; put the store in "
                                          r"DATASETS_PATH"):
        load_config(None, environ={"DATASETS": "s3://bucket/photos"})
