"""Policy files: schema, strict loader, hot reload."""
