"""The forward's prologue: the tokens' embedding rows, the empty residual stream they join, their positions."""
