"""The ground floor: units, errors with their exit codes, the vocabulary of every enum, YAML
reading, the scenario schema, the runtime limits and the job backends. Nothing here imports the
rest of collsim."""
