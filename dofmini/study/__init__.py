"""Tools for studying the method: not needed to estimate DoF or to distill."""
