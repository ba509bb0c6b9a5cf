"""Published JSON Schema documents of the audit events, one file per schema version."""
