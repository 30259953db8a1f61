"""Cost model, profiles and planners."""
