"""The controller's reservation flags: durations as the profile writes them, bad values refused."""

from __future__ import annotations

import argparse

import pytest

from topodra.controller import main as controller_main


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    controller_main.configure(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_durations() -> None:
    a = parse()
    assert (a.reservations, a.reservation_after, a.reservation_max_hold, a.max_reservations) == ("on", 900, 86400, 2)
    assert (a.reservation_grace, a.reservation_cooldown) == (900, 1800)
    a = parse("--reservations=off", "--reservation-after=1h30m", "--reservation-max-hold=90", "--max-reservations=0")
    assert (a.reservations, a.reservation_after, a.reservation_max_hold, a.max_reservations) == ("off", 5400, 90, 0)


@pytest.mark.parametrize("argv", [["--reservation-after=15 minutes"], ["--reservation-max-hold=8d"],
                                  ["--reservations=maybe"]])
def test_bad_values_are_refused(argv: list[str]) -> None:
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parse(*argv)
