"""The configuration matrix (`accucheck matrix`): flip one knob at a time from a baseline and
say which knobs move the numbers, for which request, and where in the model the change starts.

knobs (what can be flipped, checked before any engine starts) -> engines (the runs, teacher-
forced) -> measure (per request against the baseline) -> localise (capture + diff of a moved
run) -> run (the matrix and its invariance contract) -> render / main (text, JSON, HTML, DIR).
Uses capture to run engines, verdict / report for the diff; signoff shows a scenario's matrix.
"""
