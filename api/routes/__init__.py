"""One router per resource, included explicitly by ``api.app.create_app``."""
