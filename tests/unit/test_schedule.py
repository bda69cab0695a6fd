"""The LR schedule: saved with the checkpoint, and re-planned when a resume at another world size changes the
steps left (``trainer.epochs`` mode).
"""

from __future__ import annotations

import math

import torch

from pitstop.parts.lr import replan, warmup_cosine


def lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def fresh(total: int):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return warmup_cosine(opt, total_steps=total, warmup_steps=5, min_lr_ratio=0.01)


def test_warmup_then_cosine_to_the_floor():
    got = lrs(fresh(50), 51)
    assert got[0] == 0.1 * (1 / 5) and got[4] == 0.1
    w = 5  # the closed form, bit for bit
    assert got[30] == 0.1 * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * ((30 - w) / (50 - w)))))
    assert got[50] == 0.1 * 0.01


def test_the_plan_is_saved_and_re_planned_from_where_it_was():
    a = fresh(100)
    lrs(a, 40)
    state = a.state_dict()
    # resumed where 100 steps were planned but, at the new world size, the epochs end at step 70
    b = fresh(140)  # (built at setup for the whole run at the new world size)
    b.load_state_dict(state)
    assert b.lr_lambdas[0].total_steps == 100  # the saved plan, not the one built at setup
    assert replan(b, 40, 70)
    rest = lrs(b, 31)
    assert rest[0] == lrs(a, 1)[0]  # continuous where it resumed
    assert all(x > y for x, y in zip(rest, rest[1:]))  # still decaying, to the floor at the new end
    assert math.isclose(rest[30], 0.1 * 0.01)
    c = fresh(70)  # saved after the re-plan, resumed again: the re-planned schedule goes on
    c.load_state_dict(b.state_dict())
    assert c.lr_lambdas[0].total_steps == 70 and c.lr_lambdas[0].anchor_step == 40
