"""A checkpoint shipping in place that lost files since the last look: deleted, or replaced by a new save."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptvault.ops import pin as pins
from ckptvault.ops.watch_candidate import Candidate
from ckptvault.ops.watch_complete import Completeness
from ckptvault.ops.watch_in_place import InPlaceShipping

OLD = (("a.bin", "f", "100", "1"), ("b.bin", "f", "50", "1"))  # the save the last look saw


def said_lost(tmp_path: Path, now: pins.Signature, *, steady: bool, saved_anew: bool = False) -> str:
    """The reason a checkpoint shipping in place, last seen as ``OLD`` (``steady``: unchanged at that look), is
    said lost for, when a look finds ``now``."""
    (tmp_path / "step_100").mkdir()
    reasons: list[str] = []
    shipping = InPlaceShipping(
        pins_dir=str(tmp_path / "pins"),
        vault=None,
        excluded=None,
        signature=lambda pin: now,
        done={},
        warn_once=lambda key, message: None,
        on_warning=lambda message: None,
        report_lost=lambda cand, step, reason, error: reasons.append(reason),
        release=lambda cand: None,
        pin_retry_s=5.0,
        pin_meta=lambda pin: {},
    )
    pin = pins.stand_in(str(tmp_path / "step_100"), str(tmp_path / "pins"))
    cand = Candidate(pin=pin, seen=0.0, last_change=0.0, sig=OLD, steady=steady)
    cand.saved_anew = saved_anew
    assert shipping.cut_down(cand, now)
    (reason,) = reasons
    return reason


def looks_settling_after(settle: float) -> Completeness:
    """The watcher's looks at a checkpoint, with nothing else of the watcher."""
    return Completeness(
        folder=None,  # type: ignore[arg-type]  # what it knows of trainers is not asked here
        settle=settle,
        excluded=None,
        on_warning=lambda message: None,
        warn_once=lambda key, message: None,
        release=lambda cand: None,
    )


@pytest.mark.parametrize(
    ("now", "steady", "reason"),
    [
        # its own save still being written: a file grows while another goes (a rotation): said "replaced"
        ((("a.bin", "f", "200", "2"),), False, "deleted"),
        ((("a.bin", "f", "200", "2"),), True, "deleted"),  # appended to: a file being written only grows
        # a file come while its save was still changing may be that save's
        ((("a.bin", "f", "100", "1"), ("c.bin", "f", "9", "2")), False, "deleted"),
        # a file come after its save was done, or one rewritten (changed, not grown): another save
        ((("a.bin", "f", "100", "1"), ("c.bin", "f", "9", "2")), True, "replaced"),
        ((("a.bin", "f", "80", "2"),), False, "replaced"),
        ((("a.bin", "f", "100", "2"),), False, "replaced"),
        ((("a.bin", "f", "100", "1"),), True, "deleted"),
    ],
)
def test_a_checkpoint_cut_down_in_place_is_replaced_only_by_another_save(tmp_path, now, steady, reason):
    assert said_lost(tmp_path, now, steady=steady) == reason


def test_a_new_save_seen_at_an_earlier_look_makes_a_later_loss_a_replacement(tmp_path):
    """The new save's file came at one look, the old save's file went at the next: no one look sees both."""
    looks = looks_settling_after(600.0)
    cand = Candidate(pin=None, seen=0.0, last_change=0.0, sig=OLD, steady=True)  # type: ignore[arg-type]
    looks.count_rewrites(cand, (*OLD, ("c.bin", "f", "9", "2")), 1.0)
    assert cand.saved_anew
    assert said_lost(tmp_path, (("a.bin", "f", "100", "1"),), steady=False, saved_anew=True) == "replaced"


def test_a_new_save_that_settled_makes_a_later_loss_a_deletion(tmp_path):
    """Saved again in place, then settled (it ships as it is), then files of it deleted by a rotation: the save
    in place is done with, and the loss is a deletion (rv56: saved_anew was never reset)."""
    looks = looks_settling_after(5.0)
    cand = Candidate(pin=None, seen=0.0, last_change=0.0, sig=OLD, steady=True)  # type: ignore[arg-type]
    saved = (*OLD, ("c.bin", "f", "9", "2"))
    looks.count_rewrites(cand, saved, 1.0)
    cand.sig, cand.last_change = saved, 1.0  # as the watcher records a change
    assert cand.saved_anew
    looks.count_rewrites(cand, saved, 7.0)  # unchanged for longer than settle
    assert not cand.saved_anew
