"""Which System V segment is a postmaster's: the one it created and maps, never a
leftover of a killed postmaster whose pid it now has."""

from __future__ import annotations

from worker.postmaster import segment_of

HEADER = (
    "       key      shmid perms                  size  cpid  lpid nattch   uid   gid"
    "  cuid  cgid      atime      dtime      ctime                   rss                  swap"
)


def row(key: int, shmid: int, cpid: int, nattch: int) -> str:
    return f"{key:>10} {shmid:>10}   600                    56 {cpid:>5}   511 {nattch:>6}" + (
        "   101   104   101   104 1796483349 1796483349 1796483349                  4096"
        "                     0"
    )


# pid 4242 once created 2162461 and was SIGKILLed; the pid came round again to a new
# postmaster, which created 2759903 and maps it.
LEFTOVER, OWN = row(2162461, 11468905, 4242, 0), row(2759903, 4161562, 4242, 3)
TABLE = "\n".join([HEADER, LEFTOVER, row(1001021, 10911746, 12347, 0), OWN])
MAPS = (
    "55d0c0000000-55d0c0001000 r--p 00000000 fd:00 1234  /usr/lib/postgresql/bin/postgres\n"
    f"7f5c7827c000-7f5c7827d000 rw-s 00000000 00:01 7634999  /SYSV{2759903:08x} (deleted)\n"
)


def test_the_segment_it_maps_wins_over_a_leftover_with_its_pid() -> None:
    assert segment_of(4242, TABLE, MAPS) == (2759903, 4161562)


def test_without_its_maps_the_attached_one_wins() -> None:
    assert segment_of(4242, TABLE, None) == (2759903, 4161562)


def test_a_leftover_it_does_not_map_is_not_its_segment() -> None:
    table = "\n".join([HEADER, LEFTOVER])
    assert segment_of(4242, table, MAPS) is None
    assert segment_of(4242, table, None) == (2162461, 11468905)  # all there is to go on


def test_an_unknown_table_layout_gives_nothing() -> None:
    assert segment_of(4242, "key shmid\n1 2", MAPS) is None
    assert segment_of(4242, "", None) is None
