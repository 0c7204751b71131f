"""The reporting room: what the run tells its user (docs/design.md, "Rooms of the application")."""
