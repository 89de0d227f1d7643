"""The collective-order checker (``tests/collective_order.py``) finds what NCCL would hang on: members of a group
issuing different collectives, and orders across groups that wait on each other in a cycle."""

from collective_order import Collective, collective_problems

A, B, C = (0, 1), (1, 2), (0, 2)


def _c(group, shape=(4,), op="all_reduce"):
    return Collective(op, group, shape, "torch.float32")


def test_a_sound_order_passes():
    assert collective_problems([[_c(A), _c(C)], [_c(A), _c(B)], [_c(B), _c(C)]]) == []


def test_members_issuing_different_collectives_are_named():
    problems = collective_problems([[_c(A, (4,))], [_c(A, (8,))]])
    assert len(problems) == 1 and "group [0, 1]" in problems[0] and "[8]" in problems[0]
    assert "against" in collective_problems([[_c(A), _c(A)], [_c(A)]])[0]


def test_a_cycle_across_groups_is_a_hang():
    """Each group's members agree on its order, but rank 0 waits in A for rank 1, which waits in B for rank 2,
    which waits in C for rank 0."""
    problems = collective_problems([[_c(A), _c(C)], [_c(B), _c(A)], [_c(C), _c(B)]])
    assert len(problems) == 1 and "forever" in problems[0] and "rank 0 waits in all_reduce[0, 1]" in problems[0]
