"""Plans: what a plan *is*. Strategy values and their text, parameter and activation
annotations, the plan file's JSON schema. ``hspmd.planner`` searches for one; this package
imports nothing of it (docs/decisions.md, "Names that say what the file holds")."""
