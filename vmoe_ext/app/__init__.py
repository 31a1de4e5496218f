"""The run assembly, above every other package: the root config schema,
resolving a config once (`schema`), the run context every mode assembles its
run from (`context`), the train / evaluate-only / carve modes (`train`,
`evaluate`, `carve`) and the binary (`main`)."""
