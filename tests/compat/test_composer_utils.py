"""Composer's utilities llm-foundry imports: ``composer.utils.get_file``, ``parse_uri``, ``retry``,
``configure_deterministic_mode`` and ``composer.core.ensure_time``. ``get_file`` copies from a real S3 API (moto's
server) and from local paths atomically, refusing to replace a file unless asked; ``retry`` calls again only on the
exceptions it names; through the Composer drop-in mode the names are ours."""

from __future__ import annotations

import importlib
from pathlib import Path

import fsspec
import pytest
import torch
from drop_in_checks import served

from fabric.compat.composer_names import COMPOSER
from fabric.plugins.io.file_helpers import get_file, parse_uri
from fabric.trainer.core.time import Time, Timestamp, TimeUnit, ensure_time
from fabric.trainer.file_names import format_name_with_dist_and_time
from fabric.utilities.retry import retry
from fabric.utilities.seed import configure_deterministic_mode


def test_parse_uri_splits_as_composer_does() -> None:
    assert parse_uri("s3://bucket/runs/ep1.pt") == ("s3", "bucket", "runs/ep1.pt")
    assert parse_uri("oci://bucket@namespace/a/b") == ("oci", "bucket", "a/b")
    assert parse_uri("/tmp/runs/ep1.pt") == ("", "", "/tmp/runs/ep1.pt")
    assert parse_uri("runs/ep1.pt") == ("", "", "runs/ep1.pt")


def test_get_file_copies_from_a_bucket_and_replaces_only_when_asked(s3_bucket: str, tmp_path: Path) -> None:
    fs = fsspec.filesystem("s3")
    fs.pipe(f"{s3_bucket}/tokenizer/vocab.json", b'{"a": 1}')
    destination = tmp_path / "local" / "vocab.json"
    get_file(f"{s3_bucket}/tokenizer/vocab.json", destination)
    assert destination.read_bytes() == b'{"a": 1}'

    fs.pipe(f"{s3_bucket}/tokenizer/vocab.json", b'{"a": 2}')
    with pytest.raises(FileExistsError, match=r"vocab\.json exists; pass overwrite=True"):
        get_file(f"{s3_bucket}/tokenizer/vocab.json", destination)
    assert destination.read_bytes() == b'{"a": 1}'
    get_file(f"{s3_bucket}/tokenizer/vocab.json", destination, overwrite=True)
    assert destination.read_bytes() == b'{"a": 2}'

    with pytest.raises(FileNotFoundError, match=r"'s3://.*/tokenizer/missing\.json' is not a file"):
        get_file(f"{s3_bucket}/tokenizer/missing.json", tmp_path / "missing.json")
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["local", "vocab.json"]  # no temporary left


def test_get_file_copies_a_local_file_and_refuses_composers_object_store_objects(tmp_path: Path) -> None:
    (tmp_path / "source.txt").write_text("weights")
    get_file(str(tmp_path / "source.txt"), tmp_path / "copy.txt")
    assert (tmp_path / "copy.txt").read_text() == "weights"
    with pytest.raises(ValueError, match=r"object_store=object\): object stores are fsspec URLs here"):
        get_file("runs/ep1.pt", tmp_path / "x", object_store=object())
    assert not (tmp_path / "x").exists()


def test_ensure_time_takes_a_time_a_time_string_or_a_number_in_the_given_unit() -> None:
    assert ensure_time("3ep", TimeUnit.BATCH) == Time(3, TimeUnit.EPOCH)
    assert ensure_time(7, TimeUnit.BATCH) == Time(7, TimeUnit.BATCH)
    assert ensure_time(Time(2, TimeUnit.TOKEN), "ba") == Time(2, TimeUnit.TOKEN)
    with pytest.raises(ValueError, match="Time string '3 epochs' is not valid"):
        ensure_time("3 epochs", TimeUnit.EPOCH)


def test_through_the_drop_in_mode_composers_names_are_ours() -> None:
    with served(COMPOSER, roots=("composer",)):
        utils = importlib.import_module("composer.utils")
        core = importlib.import_module("composer.core")
        assert (utils.get_file, utils.parse_uri, utils.ensure_time) == (get_file, parse_uri, ensure_time)
        assert (utils.retry, utils.configure_deterministic_mode) == (retry, configure_deterministic_mode)
        assert utils.format_name_with_dist_and_time is format_name_with_dist_and_time
        assert core.ensure_time is ensure_time


def test_retry_calls_again_on_the_named_exceptions_and_raises_the_last_attempts() -> None:
    calls: list[int] = []

    @retry((ConnectionError, TimeoutError), num_attempts=3, initial_backoff=0, max_jitter=0)
    def flaky(fail_times: int) -> str:
        calls.append(len(calls))
        if len(calls) <= fail_times:
            raise (ConnectionError if len(calls) % 2 else TimeoutError)(f"attempt {len(calls)}")
        return "done"

    assert flaky(2) == "done" and len(calls) == 3
    calls.clear()
    with pytest.raises(ConnectionError, match="attempt 3"):  # the last attempt's error, after 3 calls
        flaky(5)
    assert len(calls) == 3

    @retry(ConnectionError, initial_backoff=0, max_jitter=0)
    def wrong(_: int) -> None:
        calls.append(0)
        raise KeyError("not retried")

    calls.clear()
    with pytest.raises(KeyError):
        wrong(1)
    assert len(calls) == 1
    with pytest.raises(ValueError, match=r"retry\(num_attempts=0\) must be a whole number, at least 1"):
        retry(ConnectionError, num_attempts=0)


def test_format_name_with_dist_and_time_fills_composers_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    place = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}
    for name, value in place.items():
        monkeypatch.setenv(name, value)
    timestamp = Timestamp(epoch=2, batch=30, sample=480, token=0, batch_in_epoch=5, sample_in_epoch=80)
    name = format_name_with_dist_and_time(
        "{run_name}/ep{epoch}-ba{batch}-sp{sample}-in{batch_in_epoch}-{sample_in_epoch}/rank{rank}-of-{world_size}"
        "-local{local_rank}-of-{local_world_size}-node{node_rank}-{tag}",
        "gpt",
        timestamp,
        tag="final",
    )
    assert name == "gpt/ep2-ba30-sp480-in5-80/rank3-of-4-local1-of-2-node1-final"
    with pytest.raises(KeyError, match="step"):
        format_name_with_dist_and_time("{step}", "gpt", timestamp)


def test_create_interval_scheduler_answers_at_the_checkpoint_events_by_default() -> None:
    """Composer's ``create_interval_scheduler`` (llm-foundry's ``hf_checkpointer`` builds its save interval with it):
    every 2 batches, at ``BATCH_CHECKPOINT`` (after the batch's evaluation), or at ``BATCH_END`` with
    ``checkpoint_events=False``; a ``final_events`` other than those events is refused."""
    from fabric.trainer.core.events import Event
    from fabric.trainer.core.state import State
    from fabric.trainer.intervals import create_interval_scheduler

    state = State(model=torch.nn.Linear(1, 1), max_duration=Time(4, TimeUnit.BATCH))
    at_checkpoints = create_interval_scheduler("2ba")
    at_ends = create_interval_scheduler("2ba", checkpoint_events=False)
    fired: dict[str, list[int]] = {"checkpoint": [], "end": []}
    for _ in range(4):
        state.timestamp = state.timestamp.to_next_batch(1, 0)
        batch = int(state.timestamp.batch)
        for event in (Event.BATCH_END, Event.BATCH_CHECKPOINT):
            if at_checkpoints(state, event):
                fired["checkpoint"].append(batch)
                assert event is Event.BATCH_CHECKPOINT
            if at_ends(state, event):
                fired["end"].append(batch)
                assert event is Event.BATCH_END
    assert fired == {"checkpoint": [2, 4], "end": [2, 4]}
    with pytest.raises(ValueError, match=r"final_events=.*fires at \['BATCH_CHECKPOINT', 'EPOCH_CHECKPOINT'\]"):
        create_interval_scheduler("2ba", final_events={Event.FIT_END})


def test_a_remote_uploader_is_none_for_a_local_folder_and_a_url_is_refused_naming_save_folder() -> None:
    from fabric.plugins.io.file_helpers import maybe_create_remote_uploader_downloader_from_uri
    from fabric.utilities.lazy import MissingConditionalImportError

    assert maybe_create_remote_uploader_downloader_from_uri("/tmp/run/hf", loggers=[]) is None
    with pytest.raises(ValueError, match=r"'s3://bucket/hf': remote folders are written through fsspec URLs here"):
        maybe_create_remote_uploader_downloader_from_uri("s3://bucket/hf", loggers=[])
    error = MissingConditionalImportError(extra_deps_group="openai", conda_package="openai")
    assert isinstance(error, ImportError) and "pip install openai" in str(error)
