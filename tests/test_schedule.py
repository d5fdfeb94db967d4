import pytest

from zerotrain.launcher.components.schedule import WarmupCosine


def test_warmup_then_cosine_to_min():
    f = WarmupCosine(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(9) == pytest.approx(0.55) and f(14) == pytest.approx(0.1)
    assert f(100) == pytest.approx(0.1)  # past the end it stays at the floor
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
