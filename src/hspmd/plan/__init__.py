"""Plans: strategy strings, parameter and activation annotations, the JSON schema."""
