"""spotcr's Lambda functions: thin handlers over logic that takes its AWS access as an adapter."""
