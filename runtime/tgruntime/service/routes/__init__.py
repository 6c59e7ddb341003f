"""The Tinker API's routes, one module per resource (mixed into app.TinkerService)."""
