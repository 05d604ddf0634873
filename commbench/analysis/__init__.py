"""The offline half: everything downstream of a results dir.

It reads files only (commbench.results is the contract) and never imports torch, so it runs
on any machine: curves (which rows count, interpolation, winners) feed report (+ plots, html),
floor (per-token cost, with models), recommend (+ commbench.engines for the settings),
qualify (specs) and compare; text formats their terminal tables.
"""
