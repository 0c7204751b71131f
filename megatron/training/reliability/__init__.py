"""The reliability room: the checks and reports around each step (docs/design.md, "Rooms")."""
