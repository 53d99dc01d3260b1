"""Tool calls as OpenAI defines them: tools and tool_choice checked, the forced call's schema, the families' parsers."""
