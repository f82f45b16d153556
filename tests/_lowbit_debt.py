"""The check both low-bit gradient stages run after resharding error-feedback residuals: the debt a
checkpoint saved (per parameter, the sum over the saving ranks of their residuals) reaches the
first reduced gradient of the run at another world size."""

from __future__ import annotations

import torch


def assert_debt_paid(delivered: dict[str, torch.Tensor], left: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                     debt: dict[str, torch.Tensor], world: int) -> None:
    """Per parameter: the reduced gradient plus the debt its own rounding leaves (``left``) is the
    exact average plus the saved ``debt``, to float32 rounding; and the debt is far above that
    rounding, so a debt dropped or counted twice fails."""
    for name, owed in debt.items():
        want = exact[name] + owed
        # float32: sums of world + 1 terms of these magnitudes, in another order
        tolerance = 8 * (world + 1) * torch.finfo(torch.float32).eps * float(want.abs().max() + owed.abs().max() + left[name].abs().max())
        assert float((delivered[name] + left[name] - want).abs().max()) <= tolerance, name
        assert float(owed.abs().max()) > 100 * tolerance, f"{name}: the debt is too small for the check to tell"
